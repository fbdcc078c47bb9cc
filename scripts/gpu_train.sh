#!/usr/bin/env bash
# One prepared GPU run: regenerate training data with the target on the
# GPU, train a drafter on it plus the committed data, and leave what a CPU machine needs
# to ship it in $OUT: the drafter (a tar split into 15 MiB parts), the new data (packed
# shards + manifest, a tar), the training metrics and the log. Sized for one H200 and the
# device limits (a ~9 minute run; at most 8 files of 16 MiB, 64 MiB in all, come back).
#
# Held-out tau is measured afterwards on the CPU (`dspine acceptance`), so the device needs
# no eval assets. Staging (target GGUF, prompt files, checkpoint) and the exact device
# calls: docs/gpu-run.md and scripts/gpu_stage.py. tests/test_gpu_script.py runs this
# script end to end on the CPU in a tiny setting.
#
# Settings (environment; defaults for the H200 run):
#   OUT            where the results go (required)
#   PYTHON         python3 with torch + transformers (default: python3; src/ is put on PYTHONPATH)
#   DEVICE         cuda | cpu (default cuda)
#   TARGET         target name or path (default smollm2-135m: its GGUF must be in $DSPINE_HOME/gguf)
#   PROMPTS        prompt sources for the data build (default: .gpu/prompts-*.jsonl)
#   BASE_DATA      committed data trained on beside the new rows (default training-data/smollm2-135m-regen)
#   DATA_SECONDS   data build time limit (default 270)   DATA_BATCH (default 256)   MAX_NEW (default 256)
#   MAX_PROMPTS    cap on prompts taken (default: none)
#   MODE           dspine | dflash (default dspine)       CONFIG (default small)
#   INIT_FROM      checkpoint to warm-start from (default .gpu/init if present, else none)
#   STEPS (default 6000)  TRAIN_SECONDS (default 200)  TRAIN_BATCH (default 32)  ANCHORS (default 32)
#   LR (default 6e-4)     WARMUP (default 100)  SOFT_LABELS (default 0 = hard labels)  MAX_LEN (default 384)
#   TRAIN_ARGS     more `dspine train` options (e.g. "--block-size 4 --threads 1" for the tiny CPU test)
#   WORK           scratch folder (default: a new temporary folder)
set -euo pipefail
: "${OUT:?set OUT to the folder that receives the results}"
abspath() { case "$1" in /*) echo "$1" ;; *) echo "$PWD/$1" ;; esac; }  # relative to the caller's folder
OUT=$(abspath "$OUT")
if [ -n "${PROMPTS:-}" ]; then PROMPTS=$(for p in $PROMPTS; do abspath "$p"; done | tr '\n' ' '); fi
if [ -n "${WORK:-}" ]; then WORK=$(abspath "$WORK"); fi
if [ -n "${INIT_FROM:-}" ]; then INIT_FROM=$(abspath "$INIT_FROM"); fi
if [ -n "${BASE_DATA:-}" ] && [ -e "$BASE_DATA" ]; then BASE_DATA=$(abspath "$BASE_DATA"); fi
if [ -d "$OUT" ] && [ -n "$(ls -A "$OUT")" ]; then
    echo "gpu_train.sh: OUT $OUT is not empty; give an empty or new folder (its files would be shipped)" >&2; exit 2
fi
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
DEVICE=${DEVICE:-cuda}
TARGET=${TARGET:-smollm2-135m}
if [ -z "${PROMPTS:-}" ]; then PROMPTS=$(ls .gpu/prompts-*.jsonl 2>/dev/null | tr '\n' ' ' || true); fi
[ -n "$PROMPTS" ] || { echo "gpu_train.sh: no prompt files (PROMPTS unset and no .gpu/prompts-*.jsonl; run scripts/gpu_stage.py)" >&2; exit 2; }
BASE_DATA=${BASE_DATA-training-data/smollm2-135m-regen}
DATA_SECONDS=${DATA_SECONDS:-270}; DATA_BATCH=${DATA_BATCH:-256}; MAX_NEW=${MAX_NEW:-256}
MODE=${MODE:-dspine}; CONFIG=${CONFIG:-small}
if [ -z "${INIT_FROM+x}" ] && [ -f .gpu/init/config.json ]; then INIT_FROM=.gpu/init; fi
STEPS=${STEPS:-6000}; TRAIN_SECONDS=${TRAIN_SECONDS:-200}; TRAIN_BATCH=${TRAIN_BATCH:-32}
ANCHORS=${ANCHORS:-32}; LR=${LR:-6e-4}; WARMUP=${WARMUP:-100}; SOFT_LABELS=${SOFT_LABELS:-0}; MAX_LEN=${MAX_LEN:-384}
WORK=${WORK:-$(mktemp -d)}
mkdir -p "$OUT" "$WORK"
LOG="$OUT/run.log"
dspine() { "$PY" -m dspine.cli "$@"; }
say() { echo "[gpu_train $(date -u +%H:%M:%S)] $*" | tee -a "$LOG" >&2; }
trap 'say "failed (exit $?) at line $LINENO: $BASH_COMMAND"' ERR

# the training settings are checked before the data build spends its time
"$PY" - "$STEPS" "$TRAIN_SECONDS" "$TRAIN_BATCH" "$ANCHORS" "$LR" "$WARMUP" "$SOFT_LABELS" "$MAX_LEN" <<'CHECK'
import sys
from dspine.train.loop import TrainConfig
s, t, b, a, lr, w, k, ml = sys.argv[1:]
try:
    assert float(t) > 0, "TRAIN_SECONDS must be > 0"
    TrainConfig(steps=int(s), time_limit=float(t), batch_size=int(b), anchors_per_seq=int(a), lr=float(lr),
                warmup=int(w), soft_topk=int(k), max_len=int(ml))
except (ValueError, AssertionError) as e:
    sys.exit(f"gpu_train.sh: bad training setting: {e}")
CHECK

say "device=$DEVICE target=$TARGET mode=$MODE prompts=[$PROMPTS] base_data=${BASE_DATA:-none} init_from=${INIT_FROM:-none}"
"$PY" - <<'EOF' 2>&1 | tee -a "$LOG" >&2
import platform, torch, transformers
dev = torch.cuda.get_device_name(0) if torch.cuda.is_available() else platform.processor() or platform.machine()
print(f"torch {torch.__version__}, transformers {transformers.__version__}, {dev}")
EOF

# 1. data: the target's own greedy answers (float32, as the committed data), new prompts only
t0=$(date +%s)
# shellcheck disable=SC2086
dspine data build --target "$TARGET" --prompts $PROMPTS --out "$WORK/data" --device "$DEVICE" \
    --dtype float32 --batch-size "$DATA_BATCH" --max-new-tokens "$MAX_NEW" --time-limit "$DATA_SECONDS" \
    ${MAX_PROMPTS:+--max-prompts "$MAX_PROMPTS"} --no-progress 2>&1 | tee -a "$LOG" >&2
dspine data pack "$WORK/data" 2>&1 | tee -a "$LOG" >&2
tar -C "$WORK" -cf "$OUT/data.tar" --exclude='*.jsonl' --exclude='.lock' data  # shipped even if training fails
say "data build + pack: $(( $(date +%s) - t0 )) s"

# 2. train on the new rows and the committed ones
t0=$(date +%s)
DATA_DIRS="$WORK/data"
if [ -n "$BASE_DATA" ]; then DATA_DIRS="$DATA_DIRS $BASE_DATA"; fi
# shellcheck disable=SC2086,SC2046
dspine train --target "$TARGET" --data $DATA_DIRS --mode "$MODE" --config "$CONFIG" --device "$DEVICE" \
    --steps "$STEPS" --time-limit "$TRAIN_SECONDS" --batch-size "$TRAIN_BATCH" --anchors "$ANCHORS" \
    --lr "$LR" --warmup "$WARMUP" --min-lr-ratio 0 --max-len "$MAX_LEN" --soft-labels "$SOFT_LABELS" \
    --eval-prompts 0 --save-every 1000000 --out "$WORK/run" ${INIT_FROM:+--init-from "$INIT_FROM"} \
    ${TRAIN_ARGS:-} 2>&1 | tr '\r' '\n' | sed '/it\/s/d' | tee -a "$LOG" >&2
[ -f "$WORK/run/final/model.safetensors" ] || { say "training left no final drafter"; exit 1; }
say "train: $(( $(date +%s) - t0 )) s"

# 3. results: at most 8 files, 16 MiB each, 64 MiB together
tar -C "$WORK/run" -cf "$WORK/drafter.tar" final
split -b 15m -d "$WORK/drafter.tar" "$OUT/drafter.tar.part"
if [ -f "$WORK/run/metrics.jsonl" ]; then cp "$WORK/run/metrics.jsonl" "$OUT/metrics.jsonl"; fi
( cd "$OUT" && sha256sum drafter.tar.part* data.tar > SHA256SUMS )
n=$(find "$OUT" -type f | wc -l); total=$(du -cb "$OUT"/* | tail -1 | cut -f1)
big=$(find "$OUT" -type f -size +16M | wc -l)
say "results: $n files, $total bytes in $OUT"
if [ "$n" -gt 8 ] || [ "$total" -gt 67108864 ] || [ "$big" -gt 0 ]; then
    say "results exceed the device limits (8 files, 16 MiB each, 64 MiB in all)"; exit 1
fi
say "done"
