#!/usr/bin/env bash
# The CPU 2-hour EAGLE-3 recipe (configs/train/smollm2_eagle3_cpu2h.yaml) end to end, each stage timed:
#   1. self-distil PROMPTS ShareGPT first turns with the target (greedy, batched; resumed if the file exists),
#   2. dump their target features once (grown, not redone, when the distilled file grew), and with
#      OVERRIDES="extra_samples=N" those of N first exchanges of DATA as written (prompts not distilled),
#   3. train a fresh head STEPS steps from the dump (no target layers in the loop),
#   4. tune its draft tree to this machine on held-out ShareGPT prompts, alone and merged with
#      10-token prompt lookup (head:path=DIR,lookup=10).
# Prints the minutes of each stage and in all; the head lands in $OUT/head, the stage seconds in $OUT.timings.
#
#   bash scripts/train_cpu2h.sh          # defaults sized to 2 hours on this machine (below)
#
# Sizes: on a 2-core AVX2 CPU without native bf16, 1536 prompts and 1250 steps took 117.9 min
# (docs/perf_log.md, 2026-12-02 sixth session), 94.3 min with the kernels of 2026-12-03 (fifteenth
# session). Where bf16 products are native (AVX512-BF16/AMX) the same budget buys more, so PROMPTS
# and STEPS default higher there (docs/perf_log.md, eighth session).
# Instances of one machine kind differ: one ran 1.4x slower, and 3072 prompts with 2400 steps took
# 109.8 min there (ninth session); held-out top-1 stayed at 0.44 either way.
# Gemma-3-270M (a base model: distilled as plain-text continuations): configs/train/gemma3_eagle3_cpu2h.yaml
# names the variables to set (512 prompts, 800 steps: 57.1 min on the AVX2 CPU, thirty-second session).
# Other variables (the tests run it on a tiny target): TARGET, DATA, REPLY_TOKENS, CONTEXT, TUNE_PROMPTS,
# OVERRIDES (extra key=value options for the dump and the training), PYTHON.
set -euo pipefail
cd "$(dirname "$0")/.."
# train/*.py run as scripts: import this checkout's selfdraft, not whatever an install elsewhere points to
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
PYTHON=${PYTHON:-python3}
CONFIG=${CONFIG:-configs/train/smollm2_eagle3_cpu2h.yaml}
NATIVE=$("$PYTHON" -c "from selfdraft.kernels import native_bf16_matmul; print(int(native_bf16_matmul('cpu')))")
if [ "$NATIVE" = 1 ]; then
  PROMPTS=${PROMPTS:-2560}; STEPS=${STEPS:-1800}
else
  PROMPTS=${PROMPTS:-1536}; STEPS=${STEPS:-1250}
fi
TARGET=${TARGET:-smollm2}
DATA=${DATA:-sharegpt}
REPLY_TOKENS=${REPLY_TOKENS:-256}
CONTEXT=${CONTEXT:-256}
TUNE_PROMPTS=${TUNE_PROMPTS:-sharegpt-heldout}
DISTILLED=${DISTILLED:-runs/distill/sharegpt_smollm2_first.jsonl}
FEATURES=${FEATURES:-runs/feats/smollm2_distilled_first}
OUT=${OUT:-runs/smollm2_eagle3_cpu2h}
read -r -a EXTRA <<< "${OVERRIDES:-}"
LOG=$OUT.timings
mkdir -p "$(dirname "$LOG")"
: > "$LOG"
START=$(date +%s)
minutes() { awk -v s="$1" 'BEGIN{printf "%.1f", s/60}'; }
stage() {  # stage NAME COMMAND...: run it, append its seconds to $LOG
  local name=$1 t0 secs
  shift
  t0=$(date +%s)
  "$@"
  secs=$(( $(date +%s) - t0 ))
  echo "$name $secs" >> "$LOG"
  echo "[cpu2h] $name: $(minutes "$secs") min" >&2
}
OPTIONS=("target=$TARGET" "data=$DISTILLED" "extra_data=$DATA" "features_dir=$FEATURES" "out_dir=$OUT" ${EXTRA[@]+"${EXTRA[@]}"})

stage distill "$PYTHON" -m selfdraft.cli distill --target "$TARGET" --data "$DATA" --max-samples "$PROMPTS" --turns first \
  --batch-size 64 --max-prompt-tokens 384 --max-new-tokens "$REPLY_TOKENS" --out "$DISTILLED" --quiet
stage dump "$PYTHON" train/dump_features.py "$CONFIG" "${OPTIONS[@]}"
stage train "$PYTHON" train/train.py "$CONFIG" "${OPTIONS[@]}" "max_steps=$STEPS"
stage tune "$PYTHON" -m selfdraft.cli tune --head "$OUT/head" --target "$TARGET" --prompts "$TUNE_PROMPTS" --limit 4 \
  --max-new-tokens 64 --max-nodes 16 --max-depth 4 --reps 3 --context "$CONTEXT" --lookup 10
echo "[cpu2h] $PROMPTS prompts, $STEPS steps: $(minutes $(( $(date +%s) - START ))) min end to end (stage seconds in $LOG)" >&2
