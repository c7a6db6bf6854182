#!/usr/bin/env bash
# Report on a training started by start_training.sh: prints the log lines not printed by an
# earlier call (a cursor file remembers where it stopped), then one status line:
#   MAXTEXT_SFT_STATUS state=running|succeeded|exited|failed exit_code=C last_step=N last_loss=L out_of_data=yes|no idle_seconds=S
# succeeded = exit code 0 and the final checkpoint (CHECKPOINTS_DIR/STEPS/model_params) exists.
# exited = exit code 0 with CHECKPOINTS_DIR in storage (gs://): the caller checks the checkpoint.
# idle_seconds = time since the last step changed (or since the start): a stall shows there.
# On failure, the last 40 log lines follow a "--- tail" line, before the status line.
# Usage: training_status.sh WORK_DIR RUN_NAME CHECKPOINTS_DIR STEPS
set -euo pipefail
export LC_ALL=C  # byte arithmetic on the log
source "$(dirname "$0")/lib.sh"
work_dir=$(resolve_dir "$1")
note_contact "$work_dir"
run_name=$2
checkpoints_dir=${3%/}
steps=$4
job_dir="$work_dir/maxtext-sft-runs/$run_name"
log="$job_dir/train.log"
cursor="$job_dir/log.cursor"

if [ ! -f "$job_dir/pid" ]; then
  echo "MAXTEXT_SFT_STATUS state=failed exit_code=none last_step=none last_loss=none reason=no-training-started"
  exit 0
fi

# The state is read before the log: once it is final, the log holds every line already.
# Liveness before the exit code: the wrapper writes its exit code before it ends, so a wrapper
# seen dead with no exit code afterwards was killed (the other order races with a clean exit).
alive=no
process_alive "$(cat "$job_dir/pid")" && alive=yes
exit_code=$(cat "$job_dir/exit_code" 2>/dev/null || echo none)

if [ "$exit_code" = none ]; then
  if [ "$alive" = yes ]; then
    state=running
  else
    state=failed  # killed without a chance to write its exit code
  fi
elif [ "$exit_code" = 0 ] && [[ "$checkpoints_dir" == gs://* ]]; then
  state=exited
elif [ "$exit_code" = 0 ] && [ -d "$checkpoints_dir/$steps/model_params" ]; then
  state=succeeded
else
  state=failed
fi

offset=$(cat "$cursor" 2>/dev/null || echo 0)
size=$(stat -c %s "$log" 2>/dev/null || echo 0)
if [ "$size" -gt "$offset" ]; then
  # At most 1 MiB per call, and only whole lines: the next call prints the rest.
  chunk=$(tail -c +"$((offset + 1))" "$log" | head -c 1048576; printf x)
  chunk=${chunk%x}
  if [[ "$chunk" == *$'\n'* ]]; then
    lines=${chunk%$'\n'*}
    printf '%s\n' "$lines"
    echo "$((offset + ${#lines} + 1))" >"$cursor"
  fi
fi

last=$(grep -a 'completed step: ' "$log" 2>/dev/null | tail -n 1 || true)
last_step=$(sed -n 's/.*completed step: \([0-9]*\).*/\1/p' <<<"$last")
last_loss=$(sed -n 's/.*[ ,]loss: \([^ ,]*\).*/\1/p' <<<"$last")
# MaxText logs this and still exits 0 when the dataset ends before STEPS.
out_of_data=no
if grep -q -a 'You may have run out of training data' "$log" 2>/dev/null; then
  out_of_data=yes
fi
# When did the last step change? The progress file keeps "STEP EPOCH" across calls.
now=$(date +%s)
read -r seen_step seen_at 2>/dev/null <"$job_dir/progress" || true  # none yet after a (re)start
if [ "${seen_step:-}" != "${last_step:-none}" ] || [ -z "${seen_at:-}" ]; then
  # Before any step was seen, idle time counts from the training's start (its pid file).
  seen_at=$now
  [ -z "${seen_step:-}" ] && seen_at=$(stat -c %Y "$job_dir/pid")
  echo "${last_step:-none} $seen_at" >"$job_dir/progress"
fi
if [ "$state" = failed ]; then
  echo "--- tail of $log"
  tail -n 40 "$log" 2>/dev/null || true
fi
echo "MAXTEXT_SFT_STATUS state=$state exit_code=$exit_code last_step=${last_step:-none} last_loss=${last_loss:-none} out_of_data=$out_of_data idle_seconds=$((now - seen_at))"
