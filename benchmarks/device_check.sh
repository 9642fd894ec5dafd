#!/bin/bash
# The device check, run on a lent CUDA machine from the repository root (it has the image's
# torch, transformers and scipy; pydantic and its needs travel as wheels in .whl/), in about
# BUDGET_S seconds (default 290) of command time:
#   0. (SOLVERS=1) benchmarks.bench_solvers on DEVICE at the SHAPE's sizes (7b: the polar factor
#      against the float32/float64 SVD at 1024 and 4096; the assignment paths at 1024 and 11008 on
#      an MLP-like similarity, random and with a planted permutation, and a uniform one: the
#      library's default path, the sparse top-64 LAPJVsp, the device auction, dense SciPy last),
#      in SOLVERS_TIMEOUT seconds (default 90; SOLVERS_ARGS replaces the sizes), into $OUT/solvers/;
#   1. (TESTS=1, the default) the `gpu` tests, in a process of their own: the other device tests
#      register the `fakegpu` PrivateUse1 backend, after which CUDA autograd fails in that process
#      (torch 2.11: "opt_ready_stream && opt_parent_stream INTERNAL ASSERT FAILED");
#      the other device tests (tests/test_device.py, fakegpu) only with FAKEGPU_TESTS=1
#      (they run on any machine);
#   2. benchmarks.bench_device: a 7B-shaped bf16 pair built on the GPU, align + merge in
#      memory, at LAYERS (default 2; the 32-layer in-memory run took 218 s on an H200);
#   3. benchmarks.bench_device_disk: a 7B-shaped bf16 pair written to local disk (WORK), then
#      `symgraph merge --device cuda` out of core, unaligned and aligned (and stage-counted at
#      STAGED_DISK), at DISK_LAYERS (default 2,32), in whatever time is left (less the
#      REGMEAN_RESERVE of step 4). Its JSON is rewritten after each run and during one, so a run
#      the timeout stops still reports (with its solver calls so far). AUCTION_LAYERS: depths
#      also aligned with the device auction forced for large squares (bench_device_disk
#      --auction-layers, a measurement switch); "auto": the deepest of DISK_LAYERS if step 0
#      found the auction faster than the sparse solve at its largest size on the random MLP
#      similarity, else none; DISCRETE_LAYERS: depths also aligned with --until discrete (the
#      sweeps end once no discrete element changes);
#   4. (REGMEAN_LAYERS set) bench_device_disk --methods regmean --skip-aligned at those depths:
#      RegMean out of core beside the plain average, in the time left (REGMEAN_RESERVE, default
#      100 s, is kept for it), into regmean.json/.md. Its spilled float64 Grams take about
#      2.75 GB a layer at 7B (per model: three of 4096² and one of 11008²), the pair about
#      0.81 GB a layer + 1.05 GB, the output half the pair: 8 layers need about 34 GB of disk.
# WORK is emptied after steps 3 and 4.
# Everything it writes goes to $OUT (the device tool's folder; /tmp/device-out elsewhere):
# env.txt, solvers.txt + solvers/ (results.json, report.md), tests.txt, bench.txt (the
# benchmarks' logs), device.json/.md, disk.json/.md, regmean.json/.md.
# Knobs (environment): BUDGET_S, TESTS_TIMEOUT, FAKEGPU_TESTS, MEMORY_BENCH (0: skip step 2),
# SOLVER_THREADS (symgraph.solve.turns.THREADS for the out-of-core runs), BENCH_TIMEOUT, SHAPE, LAYERS, STAGED, DISK_LAYERS, STAGED_DISK, WORK, REGMEAN_MEMORY_BUDGET (RegMean's; default: the engine's), MEMORY_BUDGET (the
# engine's --memory-budget), ALIGNED_FIRST (1: the aligned merge before the unaligned one),
# BUDGET_RUNS (default 2:12GB: at 2 layers one more aligned run whose caches hold the whole
# pair, so that the cost of re-reading the checkpoints shows; empty: none),
# DEVICE (default cuda; cpu for a dry run), WHEELS (0: do not install .whl/), METHODS (e.g.
# regmean: that method also merged unaligned at each depth, on random token ids), TESTS (0: skip
# step 1), SOLVERS, SOLVERS_TIMEOUT, SOLVERS_ARGS, DISK (0: skip step 3), AUCTION_LAYERS,
# DISCRETE_LAYERS, REGMEAN_LAYERS, REGMEAN_RESERVE. A dry run on the CPU at the tiny shape: DEVICE=cpu SHAPE=tiny
# WHEELS=0 TESTS=0 (with the other knobs of the real run).
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
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>&1 | tee "$OUT/env.txt"
python3 -c "import os, torch, transformers, scipy, pydantic, symgraph; print('torch', torch.__version__, 'transformers', transformers.__version__, 'scipy', scipy.__version__, torch.cuda.get_device_name() if torch.cuda.is_available() else 'no CUDA', 'cores', os.cpu_count())" 2>&1 | tee -a "$OUT/env.txt"
WORK=${WORK:-/tmp/symgraph-device-disk}
mkdir -p "$WORK"
df -h "$WORK" /tmp 2>&1 | tee -a "$OUT/env.txt"
free -g 2>&1 | tee -a "$OUT/env.txt"
DEVICE=${DEVICE:-cuda}
SHAPE=${SHAPE:-7b}
if [ "${SOLVERS:-0}" = 1 ]; then
  case "$SHAPE" in
    tiny) SIZES="--polar 64 256 --assign 64 688 --width 256" ;;
    1b) SIZES="--polar 1024 2048 --assign 1024 5632 --width 2048" ;;
    *) SIZES="--polar 1024 4096 --assign 1024 11008 --width 4096" ;;
  esac
  ST=${SOLVERS_TIMEOUT:-90}
  echo "[device_check] $((SECONDS - START)) s: solvers, ${ST} s" | tee -a "$OUT/solvers.txt"
  timeout -k 5 "$ST" python3 -m benchmarks.bench_solvers --device "$DEVICE" ${SOLVERS_ARGS:-$SIZES} \
    --kinds mlp_random mlp_planted uniform --repeat 1 --budget $((ST - 8)) --call-timeout 25 \
    --dense-timeout 25 --out "$OUT/solvers" 2>&1 | tee -a "$OUT/solvers.txt"
fi
if [ "${TESTS:-1}" = 1 ]; then
  T=${TESTS_TIMEOUT:-75}
  SYMGRAPH_GPU_TESTS=1 timeout -k 5 "$T" python3 -m pytest -q -p no:cacheprovider -p no:logging -rf tests/test_device.py -m gpu 2>&1 | tee "$OUT/tests.txt"
  if [ "${FAKEGPU_TESTS:-0}" = 1 ]; then
    timeout -k 5 "$T" python3 -m pytest -q -p no:cacheprovider -p no:logging -rf tests/test_device.py -m "not gpu and not slow" 2>&1 | tee -a "$OUT/tests.txt"
  fi
fi
if [ "${MEMORY_BENCH:-1}" = 1 ]; then
  echo "[device_check] $((SECONDS - START)) s: in-memory bench" | tee -a "$OUT/bench.txt"
  timeout -k 5 "${BENCH_TIMEOUT:-80}" python3 -m benchmarks.bench_device --shape "$SHAPE" --layers "${LAYERS:-2}" \
    --stages "${STAGED-}" --device "$DEVICE" --out "$OUT/device.json" 2>&1 | tee -a "$OUT/bench.txt"
fi
DISK_LAYERS=${DISK_LAYERS:-2,32}
AUCTION_LAYERS=${AUCTION_LAYERS-}
if [ "$AUCTION_LAYERS" = auto ]; then
  AUCTION_LAYERS=$(python3 -c '
import json, sys
try:
    v = [x for x in json.load(open(sys.argv[1])).get("auction_vs_sparse", []) if x["matrix"] == "mlp_random"]
except (OSError, ValueError):
    v = []
top = max(v, key=lambda x: x["n"]) if v else None
print(max(int(x) for x in sys.argv[2].split(",")) if top and top["auction_faster"] else "")
' "$OUT/solvers/results.json" "$DISK_LAYERS")
  echo "[device_check] AUCTION_LAYERS=auto: '${AUCTION_LAYERS}'" | tee -a "$OUT/bench.txt"
fi
RESERVE=0
if [ -n "${REGMEAN_LAYERS-}" ]; then RESERVE=${REGMEAN_RESERVE:-100}; fi
DT=$(( $(left) - RESERVE ))
echo "[device_check] $((SECONDS - START)) s: out-of-core bench, ${DT} s for it" | tee -a "$OUT/bench.txt"
if [ "${DISK:-1}" = 1 ] && [ "$DT" -gt 40 ]; then
  timeout -k 5 "$DT" python3 -m benchmarks.bench_device_disk --shape "$SHAPE" --layers "$DISK_LAYERS" \
    --stages "${STAGED_DISK-2}" --device "$DEVICE" --work "$WORK" \
    ${MEMORY_BUDGET:+--memory-budget "$MEMORY_BUDGET"} ${ALIGNED_FIRST:+--aligned-first} \
    ${METHODS:+--methods "$METHODS"} ${AUCTION_LAYERS:+--auction-layers "$AUCTION_LAYERS"} \
    ${DISCRETE_LAYERS:+--discrete-layers "$DISCRETE_LAYERS"} \
    ${SOLVER_THREADS:+--solver-threads "$SOLVER_THREADS"} --budget-runs "${BUDGET_RUNS-2:12GB}" \
    --out "$OUT/disk.json" 2>&1 | tee -a "$OUT/bench.txt"
fi
rm -rf "$WORK"
DT=$(left)
if [ -n "${REGMEAN_LAYERS-}" ] && [ "$DT" -gt 30 ]; then
  echo "[device_check] $((SECONDS - START)) s: RegMean out of core at ${REGMEAN_LAYERS} layers, ${DT} s left" | tee -a "$OUT/bench.txt"
  mkdir -p "$WORK"
  timeout -k 5 "$DT" python3 -m benchmarks.bench_device_disk --shape "$SHAPE" --layers "$REGMEAN_LAYERS" \
    --stages "" --device "$DEVICE" --work "$WORK" --methods regmean --skip-aligned \
    ${REGMEAN_MEMORY_BUDGET:+--memory-budget "$REGMEAN_MEMORY_BUDGET"} --budget-runs "" \
    --out "$OUT/regmean.json" 2>&1 | tee -a "$OUT/bench.txt"
  rm -rf "$WORK"
fi
echo "device check done in $((SECONDS - START)) s" | tee -a "$OUT/bench.txt"
