#!/bin/bash
# The device check, run on a lent CUDA machine from the repository root (it has the image's
# torch, transformers and scipy; pydantic and its needs travel as wheels in .whl/):
#   1. the `gpu` tests, in a process of their own: the other device tests register the
#      `fakegpu` PrivateUse1 backend, after which CUDA autograd fails in that process
#      (torch 2.11: "opt_ready_stream && opt_parent_stream INTERNAL ASSERT FAILED");
#   2. the other device tests (tests/test_device.py);
#   3. benchmarks.bench_device: a 7B-shaped bf16 pair, align + merge on the GPU, by depth.
# Everything it writes goes to $OUT (the device tool's folder; /tmp/device-out elsewhere).
set -u
OUT=${OUT:-/tmp/device-out}
mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site
fi
export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$PWD TRANSFORMERS_VERBOSITY=error HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/env.txt"
python3 -c "import torch, transformers, scipy, pydantic, symgraph; print('torch', torch.__version__, 'transformers', transformers.__version__, 'scipy', scipy.__version__, torch.cuda.get_device_name())" 2>&1 | tee -a "$OUT/env.txt"
T=${TESTS_TIMEOUT:-200}
SYMGRAPH_GPU_TESTS=1 timeout "$T" python3 -m pytest -q -p no:cacheprovider -p no:logging -rf tests/test_device.py -m gpu 2>&1 | tee "$OUT/tests.txt"
if [ "${FAKEGPU_TESTS:-1}" = 1 ]; then
  timeout "$T" python3 -m pytest -q -p no:cacheprovider -p no:logging -rf tests/test_device.py -m "not gpu and not slow" 2>&1 | tee -a "$OUT/tests.txt"
fi
timeout "${BENCH_TIMEOUT:-360}" python3 -m benchmarks.bench_device --shape "${SHAPE:-7b}" --layers "${LAYERS:-2,32}" \
  --stages "${STAGED-2}" --device cuda --out "$OUT/device.json" 2>&1 | tee "$OUT/bench.txt"
echo "device check done"
