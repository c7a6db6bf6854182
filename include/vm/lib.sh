# Helpers shared by the step scripts beside this file. Sourced, not run.

# WORK_DIR may be "~" or "~/..." (the remote side knows $HOME; the DAG does not).
resolve_dir() {
  case "$1" in
    "~") printf '%s\n' "$HOME" ;;
    "~/"*) printf '%s/%s\n' "$HOME" "${1#"~/"}" ;;
    *) printf '%s\n' "$1" ;;
  esac
}

activate_maxtext_venv() {
  local venv="$1/maxtext_venv"
  if [ ! -f "$venv/bin/activate" ]; then
    echo "no MaxText venv at $venv: run install_maxtext.sh first" >&2
    exit 3
  fi
  # shellcheck disable=SC1091
  source "$venv/bin/activate"
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
