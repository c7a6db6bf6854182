#!/usr/bin/env bash
# Tutorial step 4: start SFT detached, so it survives the SSH connection that started it.
# Writes WORK_DIR/maxtext-sft-runs/RUN_NAME/{train.log,metrics.jsonl,pid,exit_code}: MaxText
# writes its metrics (train and eval losses by step, JSON lines) to metrics.jsonl, as this script
# asks it with metrics_file. Safe to run twice: a running or finished training is left alone; a
# failed one is started again and MaxText resumes from its latest checkpoint (appending to the
# same metrics file). When the training exits, its "completed step" lines (at most 2000, as
# loss_history.sh thins them) are copied to STEP_LINES_URI and the metrics file to METRICS_URI
# (gs://..., or "" for none) before the exit code is written: the final loss, the loss history
# and the eval results then outlive a VM that stops itself, or is lost, after the training ended.
# Usage: start_training.sh WORK_DIR RUN_NAME ACCELERATOR_TYPE TOPOLOGY CHIPS_PER_HOST_BOUNDS STEP_LINES_URI METRICS_URI [MAXTEXT_ARG...]
#        (HF token on stdin or in HF_TOKEN)
set -euo pipefail
source "$(dirname "$0")/lib.sh"
work_dir=$(resolve_dir "$1")
note_contact "$work_dir"
run_name=$2
accelerator_type=$3
topology=$4
chips_per_host_bounds=$5
step_lines_uri=$6
metrics_uri=$7
shift 7
read_hf_token
job_dir="$work_dir/maxtext-sft-runs/$run_name"
mkdir -p "$job_dir"

if [ "$(cat "$job_dir/exit_code" 2>/dev/null)" = 0 ]; then
  echo "Training $run_name already finished (exit code 0); not starting it again"
  exit 0
fi
if [ -f "$job_dir/pid" ] && process_alive "$(cat "$job_dir/pid")"; then
  echo "Training $run_name is already running (pid $(cat "$job_dir/pid"))"
  exit 0
fi
rm -f "$job_dir/exit_code" "$job_dir/progress"
activate_maxtext_venv "$work_dir"

export TPU_ACCELERATOR_TYPE="$accelerator_type" TPU_WORKER_ID=0 TPU_NAME="$(hostname)"
export TPU_SKIP_MDS_QUERY=1 TPU_WORKER_HOSTNAMES=localhost TPU_TOPOLOGY="$topology"
export TPU_CHIPS_PER_HOST_BOUNDS="$chips_per_host_bounds" TPU_HOST_BOUNDS=1,1,1
# The exit code is written via a rename, so a reader never sees a half-written file.
# shellcheck disable=SC2016
setsid nohup bash -c '
  job_dir=$1 scripts=$2 work_dir=$3 run_name=$4 step_lines_uri=$5 metrics_uri=$6; shift 6
  # PYTHONFAULTHANDLER: a crash in native code (exit 139, SIGSEGV) prints the Python stack of
  # every thread into the log, which names where it happened.
  PYTHONFAULTHANDLER=1 python3 -m maxtext.trainers.post_train.sft.train_sft "$@" \
    "metrics_file=$job_dir/metrics.jsonl" >>"$job_dir/train.log" 2>&1
  status=$?
  # The copies log to a file of their own: the training log is what the sensor streams.
  if [ -n "$step_lines_uri" ]; then
    { bash "$scripts/loss_history.sh" "$work_dir" "$run_name" 2000 >"$job_dir/step-lines.log" &&
      gcloud storage cp "$job_dir/step-lines.log" "$step_lines_uri"; } >"$job_dir/step-lines.upload.log" 2>&1 ||
      echo "could not copy the step lines to $step_lines_uri (see $job_dir/step-lines.upload.log)" >>"$job_dir/train.log"
  fi
  if [ -n "$metrics_uri" ] && [ -f "$job_dir/metrics.jsonl" ]; then
    gcloud storage cp "$job_dir/metrics.jsonl" "$metrics_uri" >"$job_dir/metrics.upload.log" 2>&1 ||
      echo "could not copy the metrics to $metrics_uri (see $job_dir/metrics.upload.log)" >>"$job_dir/train.log"
  fi
  echo $status >"$job_dir/exit_code.tmp" && mv "$job_dir/exit_code.tmp" "$job_dir/exit_code"
' train_sft "$job_dir" "$(cd "$(dirname "$0")" && pwd)" "$work_dir" "$run_name" "$step_lines_uri" "$metrics_uri" "$@" \
  </dev/null >/dev/null 2>&1 &
echo $! >"$job_dir/pid"
echo "Started training $run_name (pid $!); log: $job_dir/train.log"
