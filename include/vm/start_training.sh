#!/usr/bin/env bash
# Tutorial step 4: start SFT detached, so it survives the SSH connection that started it.
# Writes WORK_DIR/maxtext-sft-runs/RUN_NAME/{train.log,metrics.jsonl,pid,exit_code}: MaxText
# writes its metrics (train and eval losses by step, JSON lines) to metrics.jsonl, as this script
# asks it with metrics_file. Safe to run twice: a running or finished training is left alone; a
# failed one is started again and MaxText resumes from its latest checkpoint (appending to the
# same metrics file). When the training exits, its "completed step" lines (at most 2000, as
# loss_history.sh thins them) are copied to STEP_LINES_URI, the metrics file to METRICS_URI and
# the whole log to LOG_URI (gs://..., or "" for none; one gcloud call for those in one folder)
# before the exit code is written: the final loss, the loss history, the eval results and the log
# (the task log shows only its step lines, evaluations, warnings and errors) then outlive a VM
# that stops itself, or is lost, after the training ended.
#
# On a multi-host TPU slice this script runs on every host, each with its own WORKER_ID; the
# hosts' trainings form one multi-controller JAX run (MaxText calls jax.distributed.initialize()
# with no arguments on TPU, so JAX finds its place from the environment set here):
#   TPU_WORKER_ID, TPU_WORKER_HOSTNAMES  JAX's GkeTpuCluster (jax/_src/clusters/cloud_tpu_cluster.py,
#       checked before GceTpuCluster) takes the process id and the process count from them, and the
#       first host as the coordinator; TPU_SKIP_MDS_QUERY=1 makes GceTpuCluster, which would read
#       agent-worker-number and worker-network-endpoints from the metadata server, stand aside.
#   JAX_COORDINATOR_ADDRESS  the first host at port JAX_COORDINATOR_PORT (default 8482, the port
#       cloud_tpu_cluster.py uses): jax.distributed.initialize reads it (jax/_src/distributed.py), so
#       no MEGASCALE_COORDINATOR_ADDRESS from the metadata server's tpu-env can move the coordinator.
#   TPU_HOST_BOUNDS, TPU_CHIPS_PER_HOST_BOUNDS, TPU_TOPOLOGY, TPU_ACCELERATOR_TYPE  the slice's shape,
#       as the tutorial sets them for one host.
# Every host must reach the first one on that port. A single VM (WORKER_HOSTNAMES "localhost",
# HOST_BOUNDS 1,1,1, WORKER_ID 0) gets the tutorial's environment and no coordinator address.
# Usage: start_training.sh WORK_DIR RUN_NAME ACCELERATOR_TYPE TOPOLOGY CHIPS_PER_HOST_BOUNDS HOST_BOUNDS
#            WORKER_ID WORKER_HOSTNAMES STEP_LINES_URI METRICS_URI LOG_URI [MAXTEXT_ARG...]
#        WORKER_HOSTNAMES: every host's address (host name or IPv4), comma-separated, in worker order
#        (HF token on stdin or in HF_TOKEN)
set -euo pipefail
source "$(dirname "$0")/lib.sh"
work_dir=$(resolve_dir "$1")
note_contact "$work_dir"
run_name=$2
accelerator_type=$3
topology=$4
chips_per_host_bounds=$5
host_bounds=$6
worker_id=$7
worker_hostnames=$8
step_lines_uri=$9
metrics_uri=${10}
log_uri=${11}
shift 11

# The host's place in the slice, checked before anything starts: a wrong one would only show as
# a slice that never forms (every host waiting for the coordinator until JAX's timeout).
fail_usage() {
  echo "start_training.sh: $1" >&2
  exit 2
}
host='[A-Za-z0-9]([A-Za-z0-9.-]*[A-Za-z0-9])?'
[[ $worker_hostnames =~ ^$host(,$host)*$ ]] ||
  fail_usage "WORKER_HOSTNAMES must be host names or IPv4 addresses separated by commas, got '$worker_hostnames'"
IFS=, read -r -a hosts <<<"$worker_hostnames"
[[ $worker_id =~ ^(0|[1-9][0-9]{0,5})$ ]] && [ "$worker_id" -lt "${#hosts[@]}" ] ||
  fail_usage "WORKER_ID must be a number below the number of hosts in WORKER_HOSTNAMES (${#hosts[@]}), got '$worker_id'"
[[ $host_bounds =~ ^([1-9][0-9]{0,3}),([1-9][0-9]{0,3}),([1-9][0-9]{0,3})$ ]] ||
  fail_usage "HOST_BOUNDS must be three numbers like 2,2,1, got '$host_bounds'"
slice_hosts=$((BASH_REMATCH[1] * BASH_REMATCH[2] * BASH_REMATCH[3]))
[ "$slice_hosts" -eq "${#hosts[@]}" ] ||
  fail_usage "HOST_BOUNDS $host_bounds spans $slice_hosts hosts, but WORKER_HOSTNAMES names ${#hosts[@]}"
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

export TPU_ACCELERATOR_TYPE="$accelerator_type" TPU_WORKER_ID="$worker_id" TPU_NAME="$(hostname)"
export TPU_SKIP_MDS_QUERY=1 TPU_WORKER_HOSTNAMES="$worker_hostnames" TPU_TOPOLOGY="$topology"
export TPU_CHIPS_PER_HOST_BOUNDS="$chips_per_host_bounds" TPU_HOST_BOUNDS="$host_bounds"
if [ "${#hosts[@]}" -gt 1 ]; then
  export JAX_COORDINATOR_ADDRESS="${hosts[0]}:${JAX_COORDINATOR_PORT:-8482}"
fi
# The exit code is written via a rename, so a reader never sees a half-written file.
# shellcheck disable=SC2016
setsid nohup bash -c '
  job_dir=$1 scripts=$2 work_dir=$3 run_name=$4 step_lines_uri=$5 metrics_uri=$6 log_uri=$7; shift 7
  # PYTHONFAULTHANDLER: a crash in native code (exit 139, SIGSEGV) prints the Python stack of
  # every thread into the log, which names where it happened.
  PYTHONFAULTHANDLER=1 python3 -m maxtext.trainers.post_train.sft.train_sft "$@" \
    "metrics_file=$job_dir/metrics.jsonl" >>"$job_dir/train.log" 2>&1
  status=$?
  # The copies: every file whose object is in the first object folder goes in one gcloud call
  # (the pipeline gives the three one folder, its run folder; each gcloud start costs about a
  # second of CPU), staged under its object name by a hard link; a file for another folder is
  # copied alone. They log to upload.log: the training log is what the sensor streams.
  staged=$job_dir/upload folder="" names=()
  rm -rf "$staged" && mkdir -p "$staged"
  stage() {  # FILE URI
    [ -n "$2" ] || return 0
    folder=${folder:-${2%/*}}
    if [ "${2%/*}" = "$folder" ]; then
      ln -f "$1" "$staged/${2##*/}" && names+=("${2##*/}")
    elif ! gcloud storage cp "$1" "$2" >>"$job_dir/upload.log" 2>&1; then
      echo "WARNING: could not copy $1 to $2 (see $job_dir/upload.log)" >>"$job_dir/train.log"
    fi
  }
  if [ -n "$step_lines_uri" ]; then
    if bash "$scripts/loss_history.sh" "$work_dir" "$run_name" 2000 >"$job_dir/step-lines.log" 2>>"$job_dir/upload.log"; then
      stage "$job_dir/step-lines.log" "$step_lines_uri"
    else
      echo "WARNING: could not list the step lines for $step_lines_uri (see $job_dir/upload.log)" >>"$job_dir/train.log"
    fi
  fi
  if [ -f "$job_dir/metrics.jsonl" ]; then
    stage "$job_dir/metrics.jsonl" "$metrics_uri"
  fi
  # The log last: its link is the same file, so a warning above is in the copy too.
  stage "$job_dir/train.log" "$log_uri"
  if [ "${#names[@]}" -gt 0 ] && ! (cd "$staged" && gcloud storage cp "${names[@]}" "$folder/") >>"$job_dir/upload.log" 2>&1; then
    echo "WARNING: could not copy ${names[*]} to $folder/ (see $job_dir/upload.log)" >>"$job_dir/train.log"
  fi
  echo $status >"$job_dir/exit_code.tmp" && mv "$job_dir/exit_code.tmp" "$job_dir/exit_code"
' train_sft "$job_dir" "$(cd "$(dirname "$0")" && pwd)" "$work_dir" "$run_name" "$step_lines_uri" "$metrics_uri" "$log_uri" "$@" \
  </dev/null >/dev/null 2>&1 &
echo $! >"$job_dir/pid"
echo "Started training $run_name (pid $!); log: $job_dir/train.log"
