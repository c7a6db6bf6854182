# Helpers shared by the step scripts beside this file. Sourced, not run.

# WORK_DIR may be "~" or "~/..." (the remote side knows $HOME; the DAG does not).
resolve_dir() {
  case "$1" in
    "~") printf '%s\n' "$HOME" ;;
    "~/"*) printf '%s/%s\n' "$HOME" "${1#"~/"}" ;;
    *) printf '%s\n' "$1" ;;
  esac
}

# A freshly booted Ubuntu VM is still in its first boot for minutes: cloud-init runs, and the
# apt-daily jobs' unattended-upgrades holds dpkg's lock (ansible/ansible#51663, servo/ci-runners#57:
# "Could not get lock /var/lib/dpkg/lock-frontend. It is held by process N (unattended-upgr)").
# How long a step waits for each before it gives up (seconds; set it to run by hand with another).
FIRST_BOOT_WAIT_SECONDS=${FIRST_BOOT_WAIT_SECONDS:-900}

# Until cloud-init has finished (`cloud-init status --wait`), at most FIRST_BOOT_WAIT_SECONDS; at
# once where there is no cloud-init. Its exit codes: 0 done, 1 error, 2 degraded (done with
# recoverable errors; cloud-init's cmd/status.py); only the bound passing stops the step.
wait_for_cloud_init() {
  command -v cloud-init >/dev/null || return 0
  local status=0
  timeout "$FIRST_BOOT_WAIT_SECONDS" cloud-init status --wait >/dev/null || status=$?
  case $status in
    0 | 2) return 0 ;;
    124)
      echo "cloud-init was still running after ${FIRST_BOOT_WAIT_SECONDS} s (the VM's first boot);" \
        "giving up (FIRST_BOOT_WAIT_SECONDS sets the bound)" >&2
      return 1
      ;;
    *) echo "cloud-init reports an error (cloud-init status exit $status); going on" >&2 ;;
  esac
}

# apt-get through sudo, as a careful script runs it on a VM in its first boot: the settings on
# sudo's command line (its env_reset drops an exported DEBIAN_FRONTEND; a user allowed ALL may set
# variables there, sudoers(5) SETENV), dpkg's conffile questions answered (keep the local version
# unless the default says otherwise: --force-confdef --force-confold, dpkg(1)), no stdin, and the
# package manager's locks waited for up to FIRST_BOOT_WAIT_SECONDS: dpkg's by apt itself
# (DPkg::Lock::Timeout, apt-get(8)), apt's lists lock (which `update` does not wait for) by trying
# again. When the bound passes, the message names the first-boot lock and the bound.
apt_get() {
  local deadline=$((SECONDS + FIRST_BOOT_WAIT_SECONDS)) errors status left
  errors=$(mktemp)
  while :; do
    left=$((deadline - SECONDS))
    [ "$left" -ge 1 ] || left=1
    status=0
    sudo DEBIAN_FRONTEND=noninteractive apt-get -o DPkg::Lock::Timeout="$left" \
      -o Dpkg::Options::=--force-confdef -o Dpkg::Options::=--force-confold "$@" </dev/null 2>"$errors" || status=$?
    cat "$errors" >&2
    [ "$status" -ne 0 ] || break
    # Only a lock another process holds is waited for; apt's other errors stand.
    grep -q -e 'is another process using it?' -e '^E: Unable to lock directory' "$errors" || break
    ! grep -q 'Permission denied' "$errors" || break
    if [ "$SECONDS" -ge "$deadline" ]; then
      echo "apt-get $*: the package manager's lock was still held after ${FIRST_BOOT_WAIT_SECONDS} s" \
        "(on a VM's first boot unattended-upgrades holds dpkg's lock until its upgrade run ends);" \
        "giving up (FIRST_BOOT_WAIT_SECONDS sets the bound)" >&2
      break
    fi
    sleep 5
  done
  rm -f "$errors"
  return "$status"
}

activate_maxtext_venv() {
  local venv="$1/maxtext_venv"
  if [ ! -f "$venv/bin/activate" ]; then
    echo "no MaxText venv at $venv: run install_maxtext.sh first" >&2
    exit 3
  fi
  # shellcheck disable=SC1091
  source "$venv/bin/activate"
  # Only the rehearsal makes a kit (prepare_rehearsal.sh): its presence makes this VM a rehearsal
  # VM, whose MaxText runs at toy size. The kit's sitecustomize.py patches MaxText for the toy at
  # every start of Python; PYTHONPATH comes before the standard library, so it wins over a
  # distribution's own sitecustomize.py.
  local kit_site="$1/rehearsal-kit/site"
  if [ -f "$kit_site/sitecustomize.py" ]; then
    case ":${PYTHONPATH:-}:" in
      *":$kit_site:"*) ;;
      *) export PYTHONPATH="$kit_site${PYTHONPATH:+:$PYTHONPATH}" ;;
    esac
  fi
}

# The Hugging Face token arrives on stdin (first line) so it never shows in a command line;
# MaxText reads HF_TOKEN from the environment. Run by hand: export HF_TOKEN instead.
read_hf_token() {
  if [ -z "${HF_TOKEN:-}" ] && [ ! -t 0 ]; then
    IFS= read -r HF_TOKEN || true
  fi
  if [ -n "${HF_TOKEN:-}" ]; then
    export HF_TOKEN
  fi
}

# True while the process runs; a zombie (exited, not yet reaped) counts as gone.
process_alive() {
  local state
  state=$(ps -o stat= -p "$1" 2>/dev/null) || return 1
  [ -n "$state" ] && [ "${state#Z}" = "$state" ]
}

# A value the step hands back to the pipeline (its task's XCom): one line, never a secret.
report_result() {
  printf 'MAXTEXT_SFT_RESULT %s=%s\n' "$1" "$2"
}

# True when a checkpoint step folder is complete: on a local disk Orbax renames the finished
# step into place; on GCS it writes commit_success.txt into the step folder last.
checkpoint_committed() {
  case "$1" in
    gs://*) gcloud storage objects describe "$1/commit_success.txt" >/dev/null 2>&1 ;;
    *) [ -d "$1" ] ;;
  esac
}

# Create the folder placeholder object "PATH/" for a gs:// folder (what TensorFlow's gfile and
# the Cloud console do). MaxText checks that its output folder exists after creating it; with
# etils' gcsfs backend (a VM without TensorFlow) creating a folder writes nothing, so the check
# fails for a new folder unless something is there. Run in the MaxText venv: that check uses
# google-cloud-storage, so a venv without it has nothing to satisfy.
make_gcs_folder() {
  case "$1" in
    gs://*) ;;
    *) return 0 ;;
  esac
  python3 - "$1" <<'PY'
import sys
try:
    from google.cloud import storage
except ImportError:
    sys.exit(0)
bucket, _, name = sys.argv[1][len("gs://"):].partition("/")
storage.Client().bucket(bucket).blob(name.rstrip("/") + "/").upload_from_string(b"")
PY
}

# Commands to run when the sourcing script exits, in order (one EXIT trap for all of them: a
# second `trap ... EXIT` would replace the first).
_exit_hooks=()
_run_exit_hooks() {
  local hook
  for hook in "${_exit_hooks[@]}"; do
    eval "$hook" || true
  done
}
on_exit() {
  _exit_hooks+=("$1")
  trap _run_exit_hooks EXIT
}

# The autostop watchdog's folder (see autostop.sh): what it reads to tell a busy VM from an idle one.
autostop_dir() {
  printf '%s/maxtext-sft-autostop\n' "$1"
}

# Every step script calls this once it knows WORK_DIR: the pipeline has been in touch (its
# training sensor runs training_status.sh at each poke: that is the heartbeat), and this step
# is in progress until it exits (its pid under busy/, removed on exit; the pid of a process
# killed before it could remove it no longer counts, as the watchdog checks it is alive).
note_contact() {
  local dir
  dir=$(autostop_dir "$1")
  # Best effort: a step must not fail because its heartbeat could not be written.
  mkdir -p "$dir/busy" 2>/dev/null && touch "$dir/contact" && echo $$ >"$dir/busy/$$" || return 0
  _busy_marker="$dir/busy/$$"
  on_exit 'rm -f "$_busy_marker"'
  claim_step_group "$1"
}

# A step's process group: what the pipeline ends when the step runs past its timeout, and what a
# new run of an exclusive step ends first when an earlier run is still going (sshd sends no SIGHUP
# when a connection without a pty drops, so a step whose worker died runs on). Over SSH without a
# pty, sshd makes the command's shell a session and process-group leader (OpenSSH session.c,
# do_exec_no_pty: setsid()), and the login shell's `-c 'bash SCRIPT ...'` execs the script, so the
# script leads a group of its own: it and everything it started but did not detach. The training
# and the autostop watchdog are started with setsid, in sessions of their own: never in a step's group.
#
# Exclusive steps: two runs of one on the same VM would write the same files (the MaxText venv,
# the converted checkpoint, the export, the rehearsal kit) or start two trainings. The others only
# read (training_status.sh, training_metrics.sh, loss_history.sh: the trigger's and a worker's may
# overlap) or guard themselves (autostop.sh, under its flock), and run side by side. Each host of
# a slice is its own VM, with its own records.
exclusive_step() {
  case "$1" in
    install_maxtext.sh | prepare_rehearsal.sh | convert_to_maxtext.sh | start_training.sh | export_to_hf.sh) return 0 ;;
    *) return 1 ;;
  esac
}

step_groups_dir() {
  printf '%s/maxtext-sft-steps\n' "$1"
}

# The start time of process PID (/proc/PID/stat field 22, clock ticks since boot): with the pid, it
# tells a group's leader from a later process that got the same pid.
process_start() {
  local stat
  stat=$(cat "/proc/$1/stat" 2>/dev/null) || return 1
  stat=${stat##*) }
  # shellcheck disable=SC2086
  set -- $stat
  printf '%s\n' "${20}"
}

# True while process group PGID has a process that is not a zombie.
group_alive() {
  ps -e -o pgid=,stat= | awk -v g="$1" '$1 == g && $2 !~ /^Z/ { found = 1 } END { exit !found }'
}

# End process group PGID, whose leader started at START (process_start): SIGTERM, then SIGKILL to
# what is left after GRACE seconds (default 10). Nothing to do when the group is gone, or when its
# leader's pid is another process's now. A process run as root (sudo apt-get) is signalled by its
# sudo, which relays SIGTERM (sudo(8), "Signal handling"); SIGKILL cannot be relayed, so the last
# resort goes through `sudo -n kill`. Returns 1 when something of the group is still there after
# the bound.
end_step_group() {
  local pgid=$1 start=$2 grace=${3:-10} now tenths
  [[ "$pgid" =~ ^[1-9][0-9]*$ && "$pgid" -gt 1 && "$start" =~ ^[0-9]+$ && "$grace" =~ ^[0-9]+$ ]] || {
    echo "end_step_group: want PGID START [GRACE_SECONDS], got '$*'" >&2
    return 2
  }
  if now=$(process_start "$pgid") && [ "$now" != "$start" ]; then
    return 0
  fi
  group_alive "$pgid" || return 0
  kill -TERM -- "-$pgid" 2>/dev/null || true
  for ((tenths = 0; tenths < grace * 10; tenths++)); do
    group_alive "$pgid" || return 0
    sleep 0.1
  done
  echo "process group $pgid still there $grace s after SIGTERM: sending SIGKILL" >&2
  kill -KILL -- "-$pgid" 2>/dev/null || true
  for ((tenths = 0; tenths < 50; tenths++)); do
    group_alive "$pgid" || return 0
    if [ "$tenths" -eq 10 ]; then
      sudo -n kill -KILL -- "-$pgid" 2>/dev/null || true
    fi
    sleep 0.1
  done
  echo "process group $pgid is still there after SIGKILL" >&2
  return 1
}

# Called by note_contact. Says (on stderr, for the pipeline: "MAXTEXT_SFT_STEP_GROUP PGID START")
# which group to end if this step runs past its timeout. An exclusive step also records its group
# under WORK_DIR/maxtext-sft-steps/ and first ends an earlier run of itself that is still going;
# it fails when that one cannot be ended. A script that does not lead its group (run by hand from
# another script) has no group of its own to give, and changes nothing.
claim_step_group() {
  local step=${0##*/} pgid start dir
  pgid=$(ps -o pgid= -p $$ | tr -d ' ')
  [ "$pgid" = "$$" ] && start=$(process_start $$) || return 0
  echo "MAXTEXT_SFT_STEP_GROUP $pgid $start" >&2
  exclusive_step "$step" || return 0
  dir=$(step_groups_dir "$1")
  mkdir -p "$dir"
  # The lock is held by this subshell only: nothing the step starts later inherits it.
  (
    flock 8
    if [ -f "$dir/$step.group" ] && read -r earlier earlier_start <"$dir/$step.group" && [ "$earlier" != "$pgid" ] &&
      [[ "$earlier" =~ ^[0-9]+$ ]] && group_alive "$earlier"; then
      echo "An earlier $step is still running (process group $earlier): ending it first" >&2
      end_step_group "$earlier" "$earlier_start" || {
        echo "could not end the earlier $step (process group $earlier): not starting a second beside it" >&2
        exit 1
      }
    fi
    printf '%s %s\n' "$pgid" "$start" >"$dir/$step.group.$$"
    mv "$dir/$step.group.$$" "$dir/$step.group"
  ) 8>"$dir/$step.lock" || exit 1
  _step_group_record="$dir/$step.group"
  _step_group_mine="$pgid $start"
  on_exit '[ "$(cat "$_step_group_record" 2>/dev/null)" = "$_step_group_mine" ] && rm -f "$_step_group_record"'
}

# Prints the lines of FILE that hold the fixed string TEXT, at most MAX of them, evenly spread, the
# first and the last always among them (a run record's history need not hold every step).
print_spread() {
  local text=$1 file=$2 max=$3 total every
  total=$(grep -a -F -c -- "$text" "$file" || true)
  every=$(((total + max - 1) / max))
  [ "$every" -ge 1 ] || every=1
  grep -a -F -- "$text" "$file" | awk -v every="$every" -v total="$total" '(NR - 1) % every == 0 || NR == total' || true
}
