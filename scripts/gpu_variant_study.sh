#!/usr/bin/env bash
# The GPU variant study on one H200, in one command (about 15 minutes: an on-policy run takes ~50 s and an
# off-policy run ~150 s with 8 runs sharing the GPU):
#   1. the warm start of the learning proof (fresh ~19 M OLMo-2 '20m', `rlvr sft` on
#      arith:steps=2,max_value=20,format_noise=0.8), and `rlvr eval` of it;
#   2. the five on-policy presets (configs/sweeps/onpolicy_arith.yaml: grpo, grpo_constant, dr_grpo,
#      rft, maxrl), 4 seeds each: 16 prompts x 8 samples, one optimizer step per rollout batch,
#      lr 2e-5, 50 steps (the proof's settings);
#   3. at the same time, the off-policy comparison at 32x (configs/sweeps/offpolicy_arith.yaml:
#      none, noclip, grpo_clip, gspo, cispo and clip_higher, ppo_clip at 0.2 / 0.28), 4 seeds each:
#      rollout batch 256 = 32 prompts x 8, train batch 8 -> 32 optimizer steps per rollout batch,
#      lr 1e-5, 40 rollout steps;
#   4. `rlvr report` of each suite.
# Every run dumps its rollouts and measures the gradient variance with and without a baseline every
# DIAG steps, and the off-policy runs log importance ratios, clip fractions, KL and entropy per
# optimizer step: the reports' estimator sections (docs/theory.md) come from these.
# Runs share the one GPU: PARALLEL (default 4) at a time per suite, both suites at once.
# Usage: scripts/gpu_variant_study.sh OUT_DIR [DEVICE] [SCALE] [SUITES]
#   SCALE=tiny runs the same pipeline on a CPU in a few minutes (plumbing check, no learning claim).
#   SUITES: "onpolicy offpolicy" (default) or any of onpolicy, offpolicy, lr (configs/sweeps/lr_arith.yaml:
#   the on-policy presets against the learning rate) and lr_offpolicy (lr_offpolicy_arith.yaml). SEEDS (default "0 1 2 3") picks the seeds,
#   SETTINGS (default: every one) the settings to run by name, to split one suite over calls. A second call with the same OUT_DIR reuses the
#   warm start found there, so the suites can run one call each and still start from one warm start.
#   REPORT=0 leaves the reports out (to write them elsewhere from the run folders).
#   Each step runs unless one it needs failed (scripts/steps.sh); a table of every step's outcome is
#   printed last, and the exit status is 1 when a step failed.
set -euo pipefail
source "$(dirname "$0")/steps.sh"
OUT=${1:?usage: gpu_variant_study.sh OUT_DIR [DEVICE] [SCALE]}
DEVICE=${2:-cuda}
SCALE=${3:-full}
SUITES=${4:-onpolicy offpolicy}
TASK="arith:steps=2,max_value=20,format_noise=0.8"
if [ "$SCALE" = tiny ]; then
  SIZE=tiny; SFT_STEPS=20; ON_STEPS=3; OFF_STEPS=2; VAL=16; ON_PROMPTS=4; OFF_PROMPTS=4; ENGINE=hf; PAR=2
  SEEDS="0 1"; EVAL_EVERY=1; DIAG=1
else
  SIZE=20m; SFT_STEPS=600; ON_STEPS=50; OFF_STEPS=40; VAL=500; ON_PROMPTS=16; OFF_PROMPTS=32; ENGINE=hf-fast; PAR=${PARALLEL:-4}
  SEEDS=${SEEDS:-0 1 2 3}; EVAL_EVERY=10; DIAG=5
fi
for suite in $SUITES; do
  case $suite in
    onpolicy|lr|offpolicy|lr_offpolicy) ;;
    *) echo "unknown suite '$suite': use onpolicy, offpolicy, lr and/or lr_offpolicy" >&2; exit 2 ;;
  esac
done
PY=${PYTHON:-python}
mkdir -p "$OUT"
WARM=()  # the warm-start step the others need, when this call makes it
if [ ! -f "$OUT/warm/model/config.json" ] && [ ! -f "$OUT/warm/config.json" ]; then
  step warm -- $PY -m rlvr sft --data "$TASK" --model $SIZE --out "$OUT/warm" --device "$DEVICE" --steps $SFT_STEPS \
      --batch-size 64 --lr 1e-3 --vocab-size 1024 --no-progress
  WARM=(warm)
fi
warm_eval() {
  $PY -m rlvr eval --model "$OUT/warm" --data "$TASK" --split validation --limit $VAL --max-tokens 64 \
      --device "$DEVICE" --out "$OUT/warm_eval" > "$OUT/warm_eval.txt" 2>&1
}
if [ ! -f "$OUT/warm_eval/results.json" ]; then
  step eval ${WARM[@]+"${WARM[@]}"} -- warm_eval
fi
COMMON=(model.name_or_path="$OUT/warm" data.train_source="$TASK" data.val_size=$VAL rollout.max_new_tokens=64
        engine.name=$ENGINE policy_device="$DEVICE" engine.device="$DEVICE" save_every=0 eval_every=$EVAL_EVERY
        dump_every=$DIAG log.gradient_variance_every=$DIAG)
# The suites share the GPU: all at once, in the background, each recorded as a step when it ends.
declare -A PIDS=()
START=$SECONDS
for suite in $SUITES; do
  if step_blocked "$suite" ${WARM[@]+"${WARM[@]}"}; then continue; fi
  case $suite in
    onpolicy|lr) EXTRA=(n_steps=$ON_STEPS rollout.n_prompts_per_rollout_batch=$ON_PROMPTS optim.gradient_accumulation_steps=1) ;;
    offpolicy|lr_offpolicy) EXTRA=(n_steps=$OFF_STEPS rollout.n_prompts_per_rollout_batch=$OFF_PROMPTS) ;;
  esac
  $PY -m rlvr sweep configs/sweeps/${suite}_arith.yaml --out "$OUT/$suite" --max-parallel $PAR --seeds $SEEDS \
      ${SETTINGS:+--settings $SETTINGS} --set "${COMMON[@]}" "${EXTRA[@]}" > "$OUT/$suite.log" 2>&1 &
  PIDS[$suite]=$!
done
for suite in $SUITES; do
  if [ -z "${PIDS[$suite]:-}" ]; then continue; fi
  rc=0
  wait "${PIDS[$suite]}" || rc=$?
  step_record "$suite" $rc $((SECONDS - START))
done
for suite in $SUITES; do
  if [ -f "$OUT/$suite.log" ]; then tail -n 5 "$OUT/$suite.log"; fi
  # A suite with a failed run still reports the runs that finished.
  if [ "${REPORT:-1}" = 1 ]; then
    step "${suite}_report" ${WARM[@]+"${WARM[@]}"} -- $PY -m rlvr report "$OUT/$suite" --out "$OUT/${suite}_report.md"
  fi
done
steps_summary
