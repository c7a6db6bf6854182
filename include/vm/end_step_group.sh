#!/usr/bin/env bash
# End a step that ran past its timeout: its process group (the "MAXTEXT_SFT_STEP_GROUP PGID START"
# line every step prints, lib.sh's claim_step_group) gets SIGTERM, then SIGKILL after GRACE_SECONDS.
# The pipeline runs this over a new SSH channel when a step times out, before the task's retry can
# start the step again. Safe to run twice: a group that is gone, or whose leader's pid is another
# process's now, is left alone. Exits 1 when something of the group outlived the SIGKILL.
# Usage: end_step_group.sh PGID START [GRACE_SECONDS]
set -euo pipefail
source "$(dirname "$0")/lib.sh"
if [ $# -lt 2 ] || [ $# -gt 3 ]; then
  echo "usage: end_step_group.sh PGID START [GRACE_SECONDS]" >&2
  exit 2
fi
if end_step_group "$@"; then
  echo "process group $1 of the timed-out step has ended"
else
  status=$?
  exit "$status"
fi
