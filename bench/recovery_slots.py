"""Worker-slot-seconds a run held while its VM recoveries waited (goal: 0 while waiting for capacity).

    python -m bench.recovery_slots --api http://127.0.0.1:8080 --run-id RUN [--dag-id maxtext_sft]
                                   [--token TOKEN] [--gcp-conn-id google_cloud_default]

Reads the run's recovery ledger from its output location (vm-recoveries/N.json: when the wait for
a machine began and ended, when the new VM's insert was accepted; N-resumed.json: when its training resumed
and each re-run step's seconds) and Airflow's event log (every stretch a task ran on a worker,
bench.figures.running_intervals), then prints, per recovery, two waits and the slot-seconds the
run's tasks held inside each:
  - for a machine: from the poke that found the reservation full to the try that found a machine
    free (the training sensor is deferred meanwhile: the triggerer reads the reservation, no
    worker does; the goal is 0 slot-seconds in the stretches wholly inside the wait);
  - for the new VM's SSH: from the insert to the start of the re-run steps (reschedule-mode
    pokes, each a task process on a worker for as long as its SSH attempt takes).
The Google connection (--gcp-conn-id, from this shell's Airflow connections) reads the ledger.
"""

from __future__ import annotations

import argparse
import json
import sys
import urllib.request
from collections.abc import Mapping, Sequence
from typing import Any

from bench import figures
from maxtext_sft.run.names import ledger_entry_number, ledger_resumed_name

RESUME_STEPS = ("install", "convert", "start_training")


def recovery_waits(ledger: Mapping[str, Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Per recovery of the ledger: {"recovery", "capacity": (start, end) | None, "ssh": (start, end) | None}."""
    waits = []
    for name, entry in sorted(ledger.items()):
        if ledger_entry_number(name) is None or entry.get("at") is None:
            continue
        number, inserted = entry.get("recovery"), float(entry["at"])
        capacity = entry.get("capacity_wait")
        resumed = ledger.get(ledger_resumed_name(number)) or {}
        ssh = None
        if resumed.get("resumed_at") is not None:
            rerun = sum((resumed.get("step_seconds") or {}).get(step, 0.0) for step in RESUME_STEPS)
            ssh = (inserted, max(inserted, float(resumed["resumed_at"]) - rerun))
        waits.append({"recovery": number, "capacity": tuple(map(float, capacity)) if capacity else None, "ssh": ssh})
    return sorted(waits, key=lambda wait: wait["recovery"] or 0)


def slots_in_waits(waits: Sequence[Mapping[str, Any]], stretches: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Each wait's length and the worker-slot-seconds the run's task stretches held inside it: in
    all, and in the stretches wholly inside it (pokes while waiting; the goal is none). The ones
    across its start or end are its bookends: the try that began the wait (and deferred), the one
    that ended it."""
    rows = []
    for wait in waits:
        row: dict[str, Any] = {"recovery": wait["recovery"]}
        for kind in ("capacity", "ssh"):
            window = wait[kind]
            if not window:
                row.update({f"{kind}_wait_seconds": None, f"{kind}_slot_seconds": None,
                            f"{kind}_slot_seconds_inside": None, f"{kind}_stretches_inside": 0})
                continue
            touching = [s for s in stretches if figures.overlap((s["start"], s["end"]), window) > 0]
            inside = [s for s in touching if window[0] < s["start"] and s["end"] < window[1]]
            row[f"{kind}_wait_seconds"] = round(window[1] - window[0], 1)
            row[f"{kind}_slot_seconds"] = round(figures.slots_during(touching, window), 2)
            row[f"{kind}_slot_seconds_inside"] = round(figures.slots_during(inside, window), 2)
            row[f"{kind}_stretches_inside"] = len(inside)
        rows.append(row)
    return rows


def report(rows: Sequence[Mapping[str, Any]]) -> str:
    if not rows:
        return "This run made no VM recovery."
    lines = []
    for row in rows:
        number = row["recovery"]
        if row["capacity_wait_seconds"] is None:
            lines.append(f"recovery {number}: a machine was free at once (no capacity wait)")
        else:
            lines.append(
                f"recovery {number}: waited {row['capacity_wait_seconds']:.1f} s for a machine; worker-slot-seconds "
                f"held while waiting: {row['capacity_slot_seconds_inside']:.2f} ({row['capacity_stretches_inside']} "
                f"task stretches), {row['capacity_slot_seconds']:.2f} with the tries that began and ended the wait"
            )
        if row["ssh_wait_seconds"] is not None:
            lines.append(
                f"recovery {number}: waited {row['ssh_wait_seconds']:.1f} s for the new VM's SSH; worker-slot-seconds "
                f"held meanwhile: {row['ssh_slot_seconds']:.2f} ({row['ssh_stretches_inside']} pokes wholly inside)"
            )
    return "\n".join(lines)


class AirflowApi:
    """The few REST calls this needs (Airflow 3's /api/v2), with a bearer token."""

    def __init__(self, url: str, token: str | None):
        self.url = url.rstrip("/")
        self.token = token or self._get("/auth/token", auth=False)["access_token"]

    def _get(self, path: str, auth: bool = True) -> Any:
        request = urllib.request.Request(self.url + path)
        if auth:
            request.add_header("Authorization", f"Bearer {self.token}")
        with urllib.request.urlopen(request, timeout=30) as response:
            return json.load(response)

    def spec(self, dag_id: str, run_id: str) -> dict:
        path = f"/api/v2/dags/{dag_id}/dagRuns/{run_id}/taskInstances/plan_run/xcomEntries/spec"
        value = self._get(path)["value"]
        return json.loads(value) if isinstance(value, str) else value

    def event_logs(self, dag_id: str, run_id: str) -> list[dict]:
        rows, offset = [], 0
        while True:
            page = self._get(f"/api/v2/eventLogs?dag_id={dag_id}&run_id={run_id}&order_by=id&limit=100&offset={offset}")
            rows += page["event_logs"]
            offset += len(page["event_logs"])
            if len(page["event_logs"]) < 100:
                return rows


def measure(api: AirflowApi, dag_id: str, run_id: str, gcp_conn_id: str) -> list[dict[str, Any]]:
    from maxtext_sft.tasks.summarize import recovery_ledger

    ledger = recovery_ledger(api.spec(dag_id, run_id), gcp_conn_id)
    stretches = [s for s in figures.running_intervals(api.event_logs(dag_id, run_id)) if s["run_id"] == run_id]
    return slots_in_waits(recovery_waits(ledger), stretches)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--api", required=True, help="Airflow's API server, e.g. http://127.0.0.1:8080")
    parser.add_argument("--run-id", required=True)
    parser.add_argument("--dag-id", default="maxtext_sft")
    parser.add_argument("--token", help="an API token (default: asked from /auth/token, as the simple auth manager gives)")
    parser.add_argument("--gcp-conn-id", default="google_cloud_default")
    parser.add_argument("--json", action="store_true", help="print the rows as JSON too")
    args = parser.parse_args(argv)
    rows = measure(AirflowApi(args.api, args.token), args.dag_id, args.run_id, args.gcp_conn_id)
    print(report(rows))
    if args.json:
        print(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
