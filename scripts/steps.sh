# Steps of a GPU script that all run even when one fails, and a summary of them at the end: a lent
# machine's call is too dear to lose the later steps' results to an earlier step's failure.
# Source it (bash), then:
#   step NAME [NEEDS...] -- COMMAND [ARGS...]
#       runs COMMAND, unless a step named in NEEDS did not succeed (then it is skipped, with the reason);
#       always returns 0, so that `set -e` does not stop the script
#   step_blocked NAME [NEEDS...]
#       records NAME as skipped and returns 0 when a step named in NEEDS did not succeed, else returns 1
#       (for a step run in the background)
#   step_record NAME STATUS SECONDS
#       records a step run in the background by its exit status
#   steps_summary
#       prints the card (nvidia-smi, where there is one) and a table of every step's outcome; returns 1
#       when a step failed
declare -a STEP_NAMES=()
declare -A STEP_STATUS=() STEP_REASON=() STEP_SECONDS=()

step_record() {
  local name=$1 rc=$2 seconds=$3
  STEP_NAMES+=("$name")
  STEP_SECONDS[$name]=$seconds
  if [ "$rc" -eq 0 ]; then
    STEP_STATUS[$name]=ok
    STEP_REASON[$name]=""
  else
    STEP_STATUS[$name]=failed
    STEP_REASON[$name]="exit status $rc"
  fi
  echo "[step] $name: ${STEP_STATUS[$name]} in ${seconds} s ${STEP_REASON[$name]}" >&2
}

step_blocked() {
  local name=$1 need
  shift
  for need in "$@"; do
    if [ "${STEP_STATUS[$need]:-}" != ok ]; then
      STEP_NAMES+=("$name")
      STEP_STATUS[$name]=skipped
      STEP_SECONDS[$name]=0
      case "${STEP_STATUS[$need]:-}" in
        failed) STEP_REASON[$name]="needs $need, which failed (${STEP_REASON[$need]})" ;;
        skipped) STEP_REASON[$name]="needs $need, which was skipped" ;;
        *) STEP_REASON[$name]="needs $need, which did not run" ;;
      esac
      echo "[step] $name: skipped (${STEP_REASON[$name]})" >&2
      return 0
    fi
  done
  return 1
}

step() {
  local name=$1
  shift
  local needs=()
  while [ $# -gt 0 ] && [ "$1" != -- ]; do
    needs+=("$1")
    shift
  done
  shift # the --
  if step_blocked "$name" ${needs[@]+"${needs[@]}"}; then return 0; fi
  local start=$SECONDS rc=0
  "$@" || rc=$?
  step_record "$name" "$rc" $((SECONDS - start))
  return 0
}

steps_summary() {
  local name failed=0 card=""
  if command -v nvidia-smi > /dev/null 2>&1; then
    card=$(nvidia-smi --query-gpu=name,memory.total --format=csv,noheader 2> /dev/null | paste -sd ';' -)
  fi
  echo
  echo "card: ${card:-no GPU found by nvidia-smi}"
  echo
  echo "| step | outcome | s | reason |"
  echo "|---|---|---:|---|"
  for name in ${STEP_NAMES[@]+"${STEP_NAMES[@]}"}; do
    echo "| $name | ${STEP_STATUS[$name]} | ${STEP_SECONDS[$name]} | ${STEP_REASON[$name]} |"
    if [ "${STEP_STATUS[$name]}" = failed ]; then failed=1; fi
  done
  return $failed
}
