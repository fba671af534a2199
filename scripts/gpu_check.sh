#!/usr/bin/env bash
# make gpu-check: the tests marked gpu, then the speed benchmark's smoke run (`make gpu-test`,
# `make gpu-smoke`). Both run even when the first fails; a table of both outcomes, under the card they
# ran on, is printed last, and the exit status is 1 when either failed.
set -uo pipefail
cd "$(dirname "$0")/.."
source scripts/steps.sh
MAKE=${MAKE:-make}
step gpu-test -- $MAKE --no-print-directory gpu-test
step gpu-smoke -- $MAKE --no-print-directory gpu-smoke
steps_summary
