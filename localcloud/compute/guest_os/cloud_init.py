#!/usr/bin/python3
"""localcloud's cloud-init of a sandbox VM (see localcloud/compute/first_boot.py).

Installed in the read-only overlay over every VM's /usr/bin (vm.py's boot script).
`cloud-init status [--wait] [--long] [--format tabular|json]` reads what cloud-init's run writes
and answers as cloud-init's own cloudinit/cmd/status.py does (canonical/cloud-init, 24.3 on):
  - running while /run/cloud-init/status.json exists without /run/cloud-init/result.json
    (is_running), done once a stage has a start or finish time and the result is there, "not
    started" before either; errors in a stage make it "error" (exit 1), recoverable errors
    "degraded" (exit 2), otherwise exit 0 (handle_status_args);
  - `--wait` prints a dot every 0.25 s while not started or running, then the status line (no
    newline in between since #5700);
  - the tabular line is "status: STATE"; --long adds extended_status, boot_status_code, detail
    (the datasource once known), errors and recoverable_errors (TABULAR_LONG_TMPL).
Its status files are cloud-init's shape (cloudinit/cmd/main.py status_wrapper: {"v1": {"datasource",
"init-local", "init", "modules-config", "modules-final" each {"errors", "recoverable_errors",
"start", "finished"}, "stage"}}, result.json {"v1": {"datasource", "errors", "recoverable_errors"}}),
written directly in /run/cloud-init (cloud-init writes them under /var/lib/cloud/data and links them
there); /run/cloud-init/enabled is the systemd generator's mark ("enabled-by-generator").

`cloud-init localcloud-boot SECONDS` is the VM's boot (vm.py's boot script), not a cloud-init
command: it writes the status of a run in its last stage and returns; a process left behind
finishes the run SECONDS later (0: at once), as cloud-init's modules-final ends a first boot.
"""

import json
import os
import sys
import time
from datetime import datetime, timezone

RUN_DIR = "/run/cloud-init"
STATUS_FILE = f"{RUN_DIR}/status.json"
RESULT_FILE = f"{RUN_DIR}/result.json"
DATASOURCE = "DataSourceGCELocal"  # what cloud-init finds on Compute Engine (its GCE datasource)
STAGES = ("init-local", "init", "modules-config", "modules-final")


def uptime():
    with open("/proc/uptime") as f:
        return float(f.read().split()[0])


def write_json(path, data):
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(data, f, indent=1)
    os.replace(tmp, path)


def boot_status(finished):
    """status.json of a first boot in its last stage (`finished`: all stages done)."""
    now = uptime()
    v1 = {"datasource": DATASOURCE, "stage": None if finished else "modules-final"}
    for stage in STAGES:
        done = finished or stage != "modules-final"
        v1[stage] = {"errors": [], "recoverable_errors": {}, "start": now, "finished": now if done else None}
    return {"v1": v1}


def boot(seconds):
    os.makedirs(RUN_DIR, exist_ok=True)
    with open(f"{RUN_DIR}/enabled", "w"):
        pass
    if seconds <= 0:
        write_json(STATUS_FILE, boot_status(True))
        write_json(RESULT_FILE, {"v1": {"datasource": DATASOURCE, "errors": [], "recoverable_errors": {}}})
        return 0
    write_json(STATUS_FILE, boot_status(False))
    if os.fork() > 0:
        return 0
    os.setsid()
    devnull = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(devnull, fd)
    time.sleep(seconds)  # the modelled length of cloud-init's run, not a wait for anything
    write_json(STATUS_FILE, boot_status(True))
    write_json(RESULT_FILE, {"v1": {"datasource": DATASOURCE, "errors": [], "recoverable_errors": {}}})
    os._exit(0)


def details():
    """(status, extended status, condition, boot code, detail, errors, recoverable, last update)."""
    enabled = os.path.exists(f"{RUN_DIR}/enabled")
    boot_code = "enabled-by-generator" if enabled else "unknown"
    description = ("Cloud-init enabled by systemd cloud-init-generator" if enabled
                   else "Systemd generator may not have run yet.")
    v1 = {}
    if os.path.exists(STATUS_FILE):
        with open(STATUS_FILE) as f:
            v1 = json.load(f).get("v1", {})
    datasource = v1.get("datasource") or ""
    if datasource:
        description = datasource
    elif v1.get("stage"):
        description = f"Running in stage: {v1['stage']}"
    latest = max([0] + [max(s.get("start") or 0, s.get("finished") or 0) for s in v1.values() if isinstance(s, dict)])
    errors, recoverable = [], {}
    for _, stage in sorted(v1.items()):
        if isinstance(stage, dict):
            errors.extend(stage.get("errors", []))
            for kind, items in stage.get("recoverable_errors", {}).items():
                recoverable.setdefault(kind, []).extend(items)
    condition = "error" if errors else "degraded" if recoverable else "peachy"
    if os.path.exists(STATUS_FILE) and not os.path.exists(RESULT_FILE):
        running = "running"
    elif latest > 0:
        running = "done"
    else:
        running = "not started"
    if condition == "error":
        status, extended = "error", f"error - {running}"
    elif condition == "degraded" and running in ("done", "running"):
        status, extended = running, f"degraded {running}"
    else:
        status, extended = running, running
    last_update = datetime.fromtimestamp(latest, tz=timezone.utc).strftime("%a, %d %b %Y %H:%M:%S %z") if latest else ""
    return {"status": status, "extended_status": extended, "condition": condition, "boot_status_code": boot_code,
            "detail": description, "errors": errors, "recoverable_errors": recoverable, "last_update": last_update,
            "datasource": datasource.partition(" ")[0].lower().replace("datasource", "")}


def status(args):
    wait = "--wait" in args or "-w" in args
    long = "--long" in args or "-l" in args
    fmt = args[args.index("--format") + 1] if "--format" in args and args.index("--format") + 1 < len(args) else "tabular"
    info = details()
    if wait:
        while info["status"] in ("not started", "running"):
            if fmt == "tabular":
                sys.stdout.write(".")
                sys.stdout.flush()
            info = details()
            time.sleep(0.25)  # cloud-init's own poll of its status files
    if fmt == "json":
        shown = {k: v for k, v in info.items() if k != "condition"}
        print(json.dumps(shown, indent=2, sort_keys=True, separators=(",", ": ")))
    else:
        print(f"status: {info['status']}")
        if long:
            last = f"last_update: {info['last_update']}\n" if info["last_update"] else ""
            errors = "\n\t- " + "\n\t- ".join(info["errors"]) if info["errors"] else " []"
            recoverable = (
                "\n" + "\n".join(f"{k}:\n\t- " + "\n\t- ".join(v) for k, v in info["recoverable_errors"].items())
                if info["recoverable_errors"] else " {}"
            )
            print(f"extended_status: {info['extended_status']}\nboot_status_code: {info['boot_status_code']}\n"
                  f"{last}detail: {info['detail']}\nerrors:{errors}\nrecoverable_errors:{recoverable}")
    return {"error": 1, "degraded": 2}.get(info["condition"], 0)


def main(argv):
    if argv[:1] == ["localcloud-boot"] and len(argv) == 2:
        return boot(float(argv[1]))
    if argv[:1] == ["status"]:
        return status(argv[1:])
    print("usage: cloud-init status [--wait] [--long] [--format tabular|json]\n"
          "cloud-init: localcloud's cloud-init models only `status`", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
