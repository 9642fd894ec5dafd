#!/bin/bash
# The anchor table (issue 43) in one run on a lent CUDA machine, from the repository root:
#   1. the wheels: symgraph's (.whl -> /tmp/site) and the peer's pins (.peerwhl -> /tmp/peersite:
#      transformers 4.50.1, tokenizers, huggingface_hub, POT, accelerate (their Trainer, for their
#      learned matching); the image's torch, numpy, scipy,
#      einops... serve both);
#   2. the two parents of Theus et al.'s protocol trained concurrently on the GPU, float32 with
#      TF32 off, into /tmp/anchor-cache (nothing persists between calls);
#   3. the whole table on the GPU (--no-train: the parents as step 2 left them), with the rows of
#      the peer's own code (their source in .peersrc, run by python3 with PYTHONPATH=/tmp/peersite,
#      on the CPU while symgraph's rows run, each on half of the cores).
# Corpus and tokenizer come from .anchor-data/ (a copy of the shared anchors/theus2025/ folder,
# which does not travel). Carry: .whl .peerwhl .peersrc .anchor-data. What comes back ($OUT, 8 files,
# the tool's limit): anchor/{results.json,report.md,curves.png,train_log_seed0.json,
# train_log_seed1.json} (rewritten after every row: a run stopped by its time limit keeps what it
# measured), log.txt and the trainers' outputs train0.txt, train1.txt.
# The commit is recorded from SYMGRAPH_COMMIT (the tree there has no .git), e.g.
#   SYMGRAPH_COMMIT=$(git rev-parse HEAD) on this side, written into the command line.
# Knobs (environment): BUDGET (s, default 400: the table's timeout is what training left of it),
# TRAIN_TIMEOUT (default 210), ROWS (a subset of the table's rows), TABLE_ARGS (more flags).
set -u
T0=$(date +%s)
OUT=${OUT:-/tmp/anchor-out}
mkdir -p "$OUT/anchor"
LOG="$OUT/log.txt"
: > "$LOG"
say() { echo "[$(( $(date +%s) - T0 )) s] $*" | tee -a "$LOG"; }
pipi() { python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$@"; }
pipi /tmp/site .whl/*.whl >>"$LOG" 2>&1 || { say "symgraph wheels failed"; exit 1; }
pipi /tmp/peersite .peerwhl/*.whl >>"$LOG" 2>&1 || { say "peer wheels failed"; exit 1; }
export PYTHONPATH=/tmp/site:$PWD TRANSFORMERS_VERBOSITY=error HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True ANCHOR_DRIVER="bash benchmarks/anchor/device.sh"
CACHE=/tmp/anchor-cache
DATA=(--corpus .anchor-data/tinyshakespeare.txt --tokenizer .anchor-data/gpt2_tokenizer --cache "$CACHE")
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader >>"$LOG" 2>&1
python3 -c "import sys, torch, transformers, symgraph; print(sys.version.split()[0], 'torch', torch.__version__, 'transformers', transformers.__version__, torch.cuda.get_device_name())" >>"$LOG" 2>&1
PYTHONPATH=/tmp/peersite python3 -c "import transformers, ot, einops; print('peer: transformers', transformers.__version__, 'POT', ot.__version__)" >>"$LOG" 2>&1
say "wheels in; SYMGRAPH_COMMIT=${SYMGRAPH_COMMIT:-unset}"
# the token ids once, before the two trainers read them from the cache
python3 -c "import sys; from benchmarks.anchor import data as D; D.load_splits(sys.argv[1], sys.argv[2], sys.argv[3])" \
  .anchor-data/tinyshakespeare.txt .anchor-data/gpt2_tokenizer "$CACHE" >>"$LOG" 2>&1 || { say "tokenizing failed"; exit 1; }
say "training both parents (float32, cuda), at most ${TRAIN_TIMEOUT:-210} s"
for s in 0 1; do
  timeout "${TRAIN_TIMEOUT:-210}" python3 -m benchmarks.anchor.train "${DATA[@]}" --seed $s --device cuda --threads 4 \
    > "$OUT/train$s.txt" 2>&1 &
done
wait
for s in 0 1; do
  grep "seed $s:\|error\|Error" "$OUT/train$s.txt" | sed "s/^/[seed $s] /" >>"$LOG"
  cp "$CACHE/parent-seed$s/train_log.json" "$OUT/anchor/train_log_seed$s.json" 2>/dev/null
done
LEFT=$(( ${BUDGET:-400} - ($(date +%s) - T0) - 5 ))
[ "$LEFT" -ge 30 ] || LEFT=30  # (timeout 0 would mean none)
say "parents trained; the table, at most $LEFT s"
timeout "$LEFT" python3 -m benchmarks.anchor "${DATA[@]}" --no-train --device cuda --out "$OUT/anchor" \
  --peer-src .peersrc/Generalized-LMC-for-Transformers --peer-python python3 --peer-pythonpath /tmp/peersite \
  --peer-work /tmp/anchor-peer --peer-parallel ${ROWS:+--rows $ROWS} ${TABLE_ARGS:-} 2>&1 | tee -a "$LOG"
say "table exit ${PIPESTATUS[0]}"
