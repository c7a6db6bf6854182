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
