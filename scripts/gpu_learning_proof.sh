#!/usr/bin/env bash
# The GPU learning proof on one H200, in one command (about 4 minutes):
#   1. warm-start a fresh ~19 M-parameter OLMo-2 ('20m') with `rlvr sft` on a harder arith setting
#      whose reference solutions are mostly written in a near-miss format (format_noise);
#   2. `rlvr eval` of the warm start (the three format categories);
#   3. GRPO (grpo preset, r1_zero prompt) with 4 seeds in parallel on the one GPU (`rlvr sweep`);
#   4. `rlvr report` with the validation accuracy over steps (mean and spread over the seeds).
# Usage: scripts/gpu_learning_proof.sh OUT_DIR [DEVICE] [SCALE]
#   SCALE=tiny runs the same pipeline on a CPU in a minute (plumbing check, no learning claim).
# Each step runs unless one it needs failed (scripts/steps.sh); a table of every step's outcome is
# printed last, and the exit status is 1 when a step failed.
set -euo pipefail
source "$(dirname "$0")/steps.sh"
OUT=${1:?usage: gpu_learning_proof.sh OUT_DIR [DEVICE] [SCALE]}
DEVICE=${2:-cuda}
SCALE=${3:-full}
TASK="arith:steps=2,max_value=20,format_noise=0.8"
if [ "$SCALE" = tiny ]; then
  SIZE=tiny; SFT_STEPS=20; STEPS=4; VAL=16; PROMPTS=4; ENGINE=hf; PAR=2
else
  SIZE=20m; SFT_STEPS=600; STEPS=50; VAL=500; PROMPTS=16; ENGINE=hf-fast; PAR=4
fi
PY=${PYTHON:-python}
mkdir -p "$OUT"
step sft -- $PY -m rlvr sft --data "$TASK" --model $SIZE --out "$OUT/warm" --device "$DEVICE" --steps $SFT_STEPS \
    --batch-size 64 --lr 1e-3 --vocab-size 1024 --no-progress
warm_eval() {
  $PY -m rlvr eval --model "$OUT/warm" --data "$TASK" --split validation --limit $VAL --max-tokens 64 \
      --device "$DEVICE" --out "$OUT/warm_eval" > "$OUT/warm_eval.txt" 2>&1
}
step eval sft -- warm_eval
step sweep sft -- $PY -m rlvr sweep configs/sweeps/main_arith.yaml --out "$OUT/sweep" --max-parallel $PAR \
    --set model.name_or_path="$OUT/warm" data.train_source="$TASK" data.val_size=$VAL n_steps=$STEPS \
          rollout.n_prompts_per_rollout_batch=$PROMPTS rollout.max_new_tokens=64 \
          optim.gradient_accumulation_steps=1 engine.name=$ENGINE policy_device="$DEVICE" engine.device="$DEVICE" \
          save_every=0
# A sweep with a failed seed still reports the seeds that finished.
step report sft -- $PY -m rlvr report "$OUT/sweep" --out "$OUT/report.md"
step seeds sft -- $PY - "$OUT/sweep" <<'PYEOF'
import json, statistics, sys
from pathlib import Path
rows = []
for run in sorted(Path(sys.argv[1]).glob("*/seed_*")):
    vals = [json.loads(l) for l in open(run / "metrics.jsonl") if '"val/reward"' in l]
    rows.append((run.name, vals[0]["val/reward"], vals[-1]["val/reward"], vals[-1]["step"]))
print("\n| seed | val acc at step 0 | final val acc | final step |\n|---|---:|---:|---:|")
for name, a, b, s in rows:
    print(f"| {name} | {a:.3f} | {b:.3f} | {s} |")
start, end = statistics.mean(r[1] for r in rows), statistics.mean(r[2] for r in rows)
print(f"| mean | {start:.3f} | {end:.3f} | |")
print(f"\nbar: final >= 2 x start ({end >= 2 * start}) and final >= start + 0.25 ({end >= start + 0.25})")
PYEOF
steps_summary
