#!/usr/bin/env bash
# The VM looks after itself (an "autostop", like SkyPilot's): a watchdog on the VM powers it off
# once nothing has needed it for IDLE_MINUTES, so a VM whose pipeline died (Airflow down, a lost
# worker) stops billing instead of running on to its maxRunDuration.
#
# The VM is busy while any of these holds:
#   - a training started by start_training.sh is alive (WORK_DIR/maxtext-sft-runs/*/pid);
#   - a step script is in progress (lib.sh's note_contact: WORK_DIR/maxtext-sft-autostop/busy/PID,
#     a pid that is no longer alive does not count);
#   - the pipeline was in touch within IDLE_MINUTES (every step touches .../contact; the training
#     sensor runs training_status.sh at each poke, so contact is its heartbeat).
# Idle since = the latest of: the last contact, the newest training exit_code, the last check that
# found the VM busy, the watchdog's start. Idle longer than IDLE_MINUTES: one log line says why,
# then `sudo -n shutdown -h now`. If sudo is refused (e.g. an OS Login user without
# roles/compute.osAdminLogin) that is logged and tried again later; the watchdog keeps running.
#
# What the power-off does on Compute Engine: stopping "from the guest OS" is one of the documented
# ways to stop an instance ("Stop or restart a Compute Engine instance",
# https://cloud.google.com/compute/docs/instances/restarting-an-instance), and a stopping instance
# goes STOPPING, then TERMINATED ("Compute Engine instance lifecycle",
# https://cloud.google.com/compute/docs/instances/instance-lifecycle). A stopped instance bills no vCPU, memory or TPU time, only its disks and static IPs
# (instances.stop reference: "Stopped instances do not incur VM usage charges while they are
# stopped. However, resources that the VM is using, such as persistent disks and static IP
# addresses, will continue to be charged until they are deleted."). scheduling.
# instanceTerminationAction (DELETE or STOP) is what Compute Engine does at the VM's time limit or
# on preemption ("Limit the run time of a VM",
# https://cloud.google.com/compute/docs/instances/limit-vm-runtime); no Google document found says
# a guest-initiated shutdown deletes the instance, so expect TERMINATED: the pipeline's delete or
# the janitor removes it (and a stopped instance gives its reservation unit back).
#
# Safe to run twice: at most one watchdog per WORK_DIR (its pid in WORK_DIR/maxtext-sft-autostop/
# pid). Running it again with another IDLE_MINUTES changes the bound the running watchdog uses
# (it re-reads .../idle_minutes at every check). Its log: .../log.
# Usage: autostop.sh WORK_DIR IDLE_MINUTES    (a positive number of minutes; fractions allowed: 0.5)
#        autostop.sh --watch WORK_DIR         (the watchdog itself, as the line above starts it)
set -euo pipefail
source "$(dirname "$0")/lib.sh"

# IDLE_MINUTES in whole seconds (rounded up); fails for anything but a positive number.
idle_seconds() {
  [[ "$1" =~ ^([0-9]+(\.[0-9]*)?|\.[0-9]+)$ ]] || return 1
  awk -v m="$1" 'BEGIN { s = m * 60; if (s <= 0) exit 1; t = int(s); if (t < s) t++; print t }'
}

# Seconds between checks: a quarter of the bound, at most 30 s (a short bound stays prompt).
check_interval() {
  awk -v s="$1" 'BEGIN { i = s / 4; if (i > 30) i = 30; if (i < 0.2) i = 0.2; printf "%.2f\n", i }'
}

mtime() {
  stat -c %Y "$1" 2>/dev/null || echo 0
}

# The watchdog of this WORK_DIR, and not a process that reused its pid.
watchdog_alive() {
  [[ "$1" =~ ^[0-9]+$ ]] && process_alive "$1" && [[ "$(ps -o args= -p "$1" 2>/dev/null)" == *"autostop.sh --watch"* ]]
}

log() {
  printf '%s %s\n' "$(date -u +%Y-%m-%dT%H:%M:%SZ)" "$*" >>"$dir/log"
}

# What keeps the VM up right now ("" when nothing does); stale busy markers are removed.
busy_reason() {
  local f pid
  for f in "$work_dir"/maxtext-sft-runs/*/pid; do
    [ -f "$f" ] || continue
    pid=$(cat "$f" 2>/dev/null || true)
    if [[ "$pid" =~ ^[0-9]+$ ]] && process_alive "$pid"; then
      f=${f%/pid}
      echo "training ${f##*/} is running (pid $pid)"
      return 0
    fi
  done
  for f in "$dir"/busy/*; do
    [ -f "$f" ] || continue
    pid=${f##*/}
    if [[ "$pid" =~ ^[0-9]+$ ]] && process_alive "$pid"; then
      echo "a step script is in progress (pid $pid)"
      return 0
    fi
    rm -f "$f"  # a step killed before its exit trap ran
  done
}

watch() {
  local idle minutes interval now busy since t f contact out started next_try=0 kept_by=""
  started=$(date +%s)
  local last_busy=$started
  minutes=$(cat "$dir/idle_minutes")
  idle=$(idle_seconds "$minutes")
  log "watchdog started (pid $$): powers the VM off after $minutes idle minutes"
  while true; do
    # A new bound from a second autostop.sh takes effect at the next check.
    if t=$(cat "$dir/idle_minutes" 2>/dev/null) && [ "$t" != "$minutes" ]; then
      if f=$(idle_seconds "$t"); then
        minutes=$t
        idle=$f
        log "idle bound is now $minutes minutes"
      fi
    fi
    interval=$(check_interval "$idle")
    busy=$(busy_reason)
    now=$(date +%s)
    [ -n "$busy" ] && last_busy=$now
    if [ "$busy" != "$kept_by" ]; then
      [ -n "$busy" ] && log "kept up: $busy"
      kept_by=$busy
    fi
    since=$last_busy
    contact=$(mtime "$dir/contact")
    if [ "$contact" -gt "$since" ]; then since=$contact; fi
    for f in "$work_dir"/maxtext-sft-runs/*/exit_code; do
      t=$(mtime "$f")
      if [ "$t" -gt "$since" ]; then since=$t; fi
    done
    if [ -z "$busy" ] && [ $((now - since)) -gt "$idle" ] && [ "$now" -ge "$next_try" ]; then
      log "powering off: idle for $((now - since)) s, over the bound of $minutes minutes ($idle s):" \
        "no training alive, no step in progress, last pipeline contact $((now - contact)) s ago"
      if out=$(sudo -n shutdown -h now 2>&1); then
        log "shutdown accepted${out:+: $out}"
        exit 0
      fi
      # Not silent, and not the end: an admin may grant sudo, or the pipeline come back.
      next_try=$((now + (idle < 60 ? idle : 60)))
      log "shutdown refused (sudo -n shutdown -h now: ${out:-no output}); the VM keeps running," \
        "trying again in $((next_try - now)) s"
    fi
    sleep "$interval"
  done
}

if [ "${1:-}" = --watch ]; then
  [ $# -eq 2 ] || { echo "usage: autostop.sh --watch WORK_DIR" >&2; exit 2; }
  work_dir=$(resolve_dir "$2")
  dir=$(autostop_dir "$work_dir")
  watch
  exit 0
fi

if [ $# -ne 2 ]; then
  echo "usage: autostop.sh WORK_DIR IDLE_MINUTES" >&2
  exit 2
fi
work_dir=$(resolve_dir "$1")
minutes=$2
if ! idle_seconds "$minutes" >/dev/null; then
  echo "IDLE_MINUTES must be a positive number of minutes (e.g. 30 or 0.5), not '$minutes'" >&2
  exit 2
fi
note_contact "$work_dir"
dir=$(autostop_dir "$work_dir")
mkdir -p "$dir"
# One launcher at a time decides whether a watchdog runs (the watchdog itself never holds this).
exec 9>"$dir/lock"
flock 9
printf '%s\n' "$minutes" >"$dir/idle_minutes.tmp"
mv "$dir/idle_minutes.tmp" "$dir/idle_minutes"
if [ -f "$dir/pid" ] && watchdog_alive "$(cat "$dir/pid")"; then
  echo "Autostop watchdog already running (pid $(cat "$dir/pid")); idle bound now $minutes minutes"
  exit 0
fi
script="$(cd "$(dirname "$0")" && pwd)/$(basename "$0")"
setsid nohup bash "$script" --watch "$work_dir" </dev/null >>"$dir/log" 2>&1 9>&- &
echo $! >"$dir/pid"
echo "Started autostop watchdog (pid $!): powers the VM off after $minutes idle minutes; log: $dir/log"
