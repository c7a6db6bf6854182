#!/usr/bin/env bash
# The training's metrics, for the run record: prints the JSON lines MaxText wrote to the metrics
# file start_training.sh names (WORK_DIR/maxtext-sft-runs/RUN_NAME/metrics.jsonl): every
# evaluation's line, and at most MAX_LINES of the training steps' lines, evenly spread, the first
# and the last always among them.
# Reads only: safe to run twice. A VM recreated mid-training has the metrics since it resumed.
# Usage: training_metrics.sh WORK_DIR RUN_NAME MAX_LINES
set -euo pipefail
export LC_ALL=C
source "$(dirname "$0")/lib.sh"
work_dir=$(resolve_dir "$1")
note_contact "$work_dir"
run_name=$2
max_lines=$3
metrics="$work_dir/maxtext-sft-runs/$run_name/metrics.jsonl"

if [ ! -f "$metrics" ]; then
  echo "no metrics file at $metrics" >&2
  exit 1
fi
grep -a -F '"eval/avg_loss"' "$metrics" || true
print_spread '"learning/loss"' "$metrics" "$max_lines"
