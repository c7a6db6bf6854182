#!/usr/bin/env bash
# The training log's per-step lines, which start_training.sh copies to storage as the training
# exits (the final loss, when the VM is gone by then): prints the "completed step" lines of the log
# (WORK_DIR/maxtext-sft-runs/RUN_NAME/train.log), at most MAX_LINES of them, evenly spread, the
# first and the last always among them.
# Reads only: safe to run twice. A VM recreated mid-training has the log since it resumed.
# Usage: loss_history.sh WORK_DIR RUN_NAME MAX_LINES
set -euo pipefail
export LC_ALL=C  # the log is bytes, whatever MaxText printed
source "$(dirname "$0")/lib.sh"
work_dir=$(resolve_dir "$1")
note_contact "$work_dir"
run_name=$2
max_lines=$3
log="$work_dir/maxtext-sft-runs/$run_name/train.log"

if [ ! -f "$log" ]; then
  echo "no training log at $log" >&2
  exit 1
fi
print_spread 'completed step: ' "$log" "$max_lines"
