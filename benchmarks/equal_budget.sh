#!/usr/bin/env bash
# Train several drafter kinds on SmolLM2 at an equal budget (same data, steps, batch, anchors, optimiser, seed),
# then evaluate them side by side with `eval.main` (greedy, and at temperature 1 when TEMPERATURES says so).
#
#   WORK=runs/equal STEPS=100 KINDS="hspec dspark dflash" benchmarks/equal_budget.sh
#
# Every run is resumable: stop the script at any moment and start it again with the same variables; a finished
# run (its exported drafter at step STEPS) is skipped, an unfinished one resumes from its latest checkpoint, an
# evaluation whose report exists is skipped. Work directories: $WORK/steps$STEPS/<kind>; reports:
# $OUT/greedy and $OUT/temperature<T>. DATA is a regenerated-conversation JSONL (`train.regenerate`; default: the
# committed data/smollm2_regen_sharegpt.jsonl, the file the reports in benchmarks/results were trained on): its
# last 8 conversations are the held-out prompts of every run's real tau.
set -euo pipefail

DATA=${DATA:-data/smollm2_regen_sharegpt.jsonl}
WORK=${WORK:-runs/equal_budget}
STEPS=${STEPS:-100}
KINDS=${KINDS:-hspec dspark dflash}
SEQ_LEN=${SEQ_LEN:-512}
BATCH=${BATCH:-4}
ANCHORS=${ANCHORS:-128}
LR=${LR:-6e-4}
EVAL_EVERY=${EVAL_EVERY:-50}
NUM_PROMPTS=${NUM_PROMPTS:-3}
TEMPERATURES=${TEMPERATURES:-0 1}
OUT=${OUT:-benchmarks/results/equal_budget_steps$STEPS}
PYTHON=${PYTHON:-python}

finished() {  # the run's exported drafter is at the last step
    "$PYTHON" - "$1/drafter/training.json" "$STEPS" <<'EOF'
import json, os, sys
path, steps = sys.argv[1], int(sys.argv[2])
sys.exit(0 if os.path.exists(path) and json.load(open(path))["step"] == steps else 1)
EOF
}

drafters=()
for kind in $KINDS; do
    dir=$WORK/steps$STEPS/$kind
    drafters+=(--drafter "$dir/drafter")
    if finished "$dir"; then
        echo "== $kind: done ($dir)"
        continue
    fi
    echo "== $kind: training to step $STEPS in $dir"
    "$PYTHON" -m train.main --config=configs/smollm2.py --workdir="$dir" \
        --config.drafter.kind="$kind" \
        --config.data.sources="regen=$DATA:1,sharegpt:1" --config.data.seq_len="$SEQ_LEN" \
        --config.data.max_anchors="$ANCHORS" --config.train.batch_size="$BATCH" \
        --config.train.learning_rate="$LR" --config.train.num_steps="$STEPS" \
        --config.train.checkpoint_every=10 --config.train.eval_every="$EVAL_EVERY" --config.train.log_every=5
done

for temperature in $TEMPERATURES; do
    if [ "$temperature" = 0 ]; then out=$OUT/greedy; else out=$OUT/temperature$temperature; fi
    if [ -e "$out/report.md" ]; then
        echo "== evaluation at temperature $temperature: done ($out)"
        continue
    fi
    echo "== evaluation at temperature $temperature -> $out"
    "$PYTHON" -m eval.main --target smollm2 "${drafters[@]}" --num-prompts "$NUM_PROMPTS" \
        --temperature "$temperature" --out "$out"
done
