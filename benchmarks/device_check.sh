#!/bin/bash
# The device check, run on a lent CUDA machine from the repository root (it has the image's
# torch, transformers and scipy; pydantic and its needs travel as wheels in .whl/), in about
# BUDGET_S seconds (default 290) of command time:
#   1. the `gpu` tests, in a process of their own: the other device tests register the
#      `fakegpu` PrivateUse1 backend, after which CUDA autograd fails in that process
#      (torch 2.11: "opt_ready_stream && opt_parent_stream INTERNAL ASSERT FAILED");
#      the other device tests (tests/test_device.py, fakegpu) only with FAKEGPU_TESTS=1
#      (they run on any machine);
#   2. benchmarks.bench_device: a 7B-shaped bf16 pair built on the GPU, align + merge in
#      memory, at LAYERS (default 2; the 32-layer in-memory run took 218 s on an H200);
#   3. benchmarks.bench_device_disk: a 7B-shaped bf16 pair written to local disk (WORK), then
#      `symgraph merge --device cuda` out of core, unaligned and aligned (and stage-counted at
#      STAGED_DISK), at DISK_LAYERS (default 2,32), in whatever time is left. Its JSON is
#      rewritten after each run and during one, so a run the timeout stops still reports.
# Everything it writes goes to $OUT (the device tool's folder; /tmp/device-out elsewhere):
# env.txt, tests.txt, bench.txt (both benchmarks' logs), device.json/.md, disk.json/.md.
# Knobs (environment): BUDGET_S, TESTS_TIMEOUT, FAKEGPU_TESTS, MEMORY_BENCH (0: skip step 2),
# BENCH_TIMEOUT, SHAPE, LAYERS, STAGED, DISK_LAYERS, STAGED_DISK, WORK, MEMORY_BUDGET (the
# engine's --memory-budget), ALIGNED_FIRST (1: the aligned merge before the unaligned one),
# BUDGET_RUNS (default 2:12GB: at 2 layers one more aligned run whose caches hold the whole
# pair, so that the cost of re-reading the checkpoints shows; empty: none),
# DEVICE (default cuda; cpu for a dry run), WHEELS (0: do not install .whl/), METHODS (e.g.
# regmean: that method also merged unaligned at each depth, on random token ids).
set -u
START=$SECONDS
BUDGET=${BUDGET_S:-290}
left() { echo $(( BUDGET - (SECONDS - START) )); }
OUT=${OUT:-/tmp/device-out}
mkdir -p "$OUT"
if [ "${WHEELS:-1}" = 1 ] && ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site
fi
export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$PWD TRANSFORMERS_VERBOSITY=error HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/env.txt"
python3 -c "import os, torch, transformers, scipy, pydantic, symgraph; print('torch', torch.__version__, 'transformers', transformers.__version__, 'scipy', scipy.__version__, torch.cuda.get_device_name(), 'cores', os.cpu_count())" 2>&1 | tee -a "$OUT/env.txt"
df -h "${WORK:-/tmp}" /tmp 2>&1 | tee -a "$OUT/env.txt"
free -g 2>&1 | tee -a "$OUT/env.txt"
T=${TESTS_TIMEOUT:-75}
SYMGRAPH_GPU_TESTS=1 timeout -k 5 "$T" python3 -m pytest -q -p no:cacheprovider -p no:logging -rf tests/test_device.py -m gpu 2>&1 | tee "$OUT/tests.txt"
if [ "${FAKEGPU_TESTS:-0}" = 1 ]; then
  timeout -k 5 "$T" python3 -m pytest -q -p no:cacheprovider -p no:logging -rf tests/test_device.py -m "not gpu and not slow" 2>&1 | tee -a "$OUT/tests.txt"
fi
DEVICE=${DEVICE:-cuda}
if [ "${MEMORY_BENCH:-1}" = 1 ]; then
  echo "[device_check] $((SECONDS - START)) s: in-memory bench" | tee -a "$OUT/bench.txt"
  timeout -k 5 "${BENCH_TIMEOUT:-80}" python3 -m benchmarks.bench_device --shape "${SHAPE:-7b}" --layers "${LAYERS:-2}" \
    --stages "${STAGED-}" --device "$DEVICE" --out "$OUT/device.json" 2>&1 | tee -a "$OUT/bench.txt"
fi
DT=$(left)
echo "[device_check] $((SECONDS - START)) s: out-of-core bench, ${DT} s left" | tee -a "$OUT/bench.txt"
if [ "$DT" -gt 40 ]; then
  timeout -k 5 "$DT" python3 -m benchmarks.bench_device_disk --shape "${SHAPE:-7b}" --layers "${DISK_LAYERS:-2,32}" \
    --stages "${STAGED_DISK-2}" --device "$DEVICE" --work "${WORK:-/tmp/symgraph-device-disk}" \
    ${MEMORY_BUDGET:+--memory-budget "$MEMORY_BUDGET"} ${ALIGNED_FIRST:+--aligned-first} \
    ${METHODS:+--methods "$METHODS"} \
    --budget-runs "${BUDGET_RUNS-2:12GB}" \
    --out "$OUT/disk.json" 2>&1 | tee -a "$OUT/bench.txt"
fi
rm -rf "${WORK:-/tmp/symgraph-device-disk}"
echo "device check done in $((SECONDS - START)) s"
