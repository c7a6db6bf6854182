"""The bench's arithmetic: pure functions of what one bench invocation recorded.

Inputs are the compute emulator's request log and operations, Airflow's event log (the audit
rows the execution API writes when a task starts running and when it leaves that state), the
run summary's phases and the deleted VMs' file manifests. No I/O here, so
tests/bench/test_figures.py checks each function on small samples.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from datetime import datetime, timezone
from typing import Any

# Events the execution API logs when a task leaves the running state (airflow's
# execution_api/routes/task_instances.py: ti_update_state logs the new state's value).
LEAVES_RUNNING = {"success", "failed", "up_for_retry", "up_for_reschedule", "deferred", "skipped", "removed",
                  "upstream_failed", "restarting", "awaiting_input"}


def parse_time(text: str | None) -> datetime | None:
    """An RFC 3339 / ISO time ("...Z" or "+00:00") as an aware datetime."""
    if not text:
        return None
    when = datetime.fromisoformat(text.replace("Z", "+00:00"))
    return when if when.tzinfo else when.replace(tzinfo=timezone.utc)


def epoch(when: datetime) -> float:
    return when.timestamp()


# ----- the VM's billed lifetime -------------------------------------------------------------

PREEMPTED = "compute.instances.preempted"


def vm_lifetimes(requests: Sequence[Mapping], operations: Iterable[Mapping]) -> dict[str, dict[str, Any]]:
    """VM name -> {"start", "end", "seconds"} (epoch seconds): from the accepted insert POST to the
    delete's operation DONE.

    The insert that made the VM is the one whose operation ended without an error (one refused on
    its operation, e.g. CONDITION_NOT_MET for a full reservation, made no VM); its POST is found in
    the request log by its requestId (the operation's clientOperationId), else the operation's
    insertTime stands for it. The end is the delete operation's endTime. A VM with no DONE delete
    has end None (still billed when the log was read). One VM per name, the last made: a name
    made several times (a Spot VM preempted and made again) has them all in `vm_lives`.
    """
    return {
        name: {key: lives[-1][key] for key in ("start", "end", "seconds")}
        for name, lives in vm_lives(requests, operations).items()
    }


def vm_lives(
    requests: Sequence[Mapping], operations: Iterable[Mapping], soft_off_seconds: float = 0.0
) -> dict[str, list[dict[str, Any]]]:
    """VM name -> every VM made under that name, oldest first: {"start", "end", "seconds",
    "ended_by", "preempted_at"} (epoch seconds).

    Each VM starts at its accepted insert (as in `vm_lifetimes`) and ends at the first end the
    cloud recorded for its name after that start and before the name's next insert: a delete
    operation's endTime ("ended_by": "delete"), or a compute.instances.preempted operation's
    endTime plus `soft_off_seconds`, the guest's soft off after which the cloud deleted it with no
    delete operation ("ended_by": "preempted"; "preempted_at" is the operation's time). A VM with
    no recorded end has end, seconds and ended_by None.
    """
    inserts: dict[str, list[Mapping]] = {}
    ends: dict[str, list[tuple[float, str]]] = {}  # name -> (when the cloud recorded it, kind)
    for op in operations:
        name = str(op.get("targetLink", "")).rstrip("/").rsplit("/", 1)[-1]
        kind = op.get("operationType")
        if op.get("status") != "DONE" or "error" in op:
            continue
        if kind == "insert":
            inserts.setdefault(name, []).append(op)
        elif kind in ("delete", PREEMPTED):
            ends.setdefault(name, []).append((epoch(parse_time(op["endTime"])), kind))
    posts: dict[tuple[str, str | None], float] = {}
    for entry in requests:
        if entry.get("method") == "POST" and entry.get("status") == 200 and str(entry.get("path", "")).endswith("/instances"):
            name = (entry.get("body") or {}).get("name")
            request_id = (entry.get("query") or {}).get("requestId")
            key = (name, request_id)
            posts.setdefault(key, epoch(parse_time(entry["time"])))  # the first acceptance
    lives: dict[str, list[dict[str, Any]]] = {}
    for name, ops in inserts.items():
        starts = []
        for op in ops:
            start = posts.get((name, op.get("clientOperationId")))
            starts.append(epoch(parse_time(op["insertTime"])) if start is None else start)
        starts.sort()
        mine = []
        for i, start in enumerate(starts):
            following = starts[i + 1] if i + 1 < len(starts) else math.inf
            found = sorted((at, kind) for at, kind in ends.get(name, ()) if start <= at <= following)
            life: dict[str, Any] = {"start": start, "end": None, "seconds": None, "ended_by": None, "preempted_at": None}
            if found:
                at, kind = found[0]
                if kind == PREEMPTED:
                    life.update(end=at + soft_off_seconds, ended_by="preempted", preempted_at=at)
                else:
                    life.update(end=at, ended_by="delete")
                life["seconds"] = life["end"] - start
            mine.append(life)
        lives[name] = mine
    return lives


def marker_times(manifest: Sequence[Mapping] | None, run_name: str) -> tuple[float | None, float | None]:
    """(start, end) of the training process from the files start_training.sh leaves on the VM:
    the pid file is written as the detached process starts, exit_code when it has ended."""
    if not manifest:
        return None, None
    suffix = f"/maxtext-sft-runs/{run_name}/"
    found = {entry["path"].rsplit("/", 1)[-1]: entry.get("mtime") for entry in manifest if suffix in entry["path"]}
    return found.get("pid"), found.get("exit_code")


# ----- where time goes ------------------------------------------------------------------------

def attribute(span: tuple[float, float], intervals: Sequence[tuple[str, float | None, float | None]],
              rest: str = "between tasks") -> dict[str, float]:
    """Seconds of `span` under each label: an instant belongs to the first interval (in the given
    order) that covers it, and to `rest` when none does. Intervals may overlap and stick out of
    the span; one with a missing end is ignored. The values add up to the span's length."""
    start, end = span
    clipped = [(label, max(a, start), min(b, end)) for label, a, b in intervals
               if a is not None and b is not None and min(b, end) > max(a, start)]
    cuts = sorted({start, end, *(a for _, a, _ in clipped), *(b for _, _, b in clipped)})
    totals: dict[str, float] = {}
    for left, right in zip(cuts, cuts[1:]):
        label = next((name for name, a, b in clipped if a <= left and right <= b), rest)
        totals[label] = totals.get(label, 0.0) + (right - left)
    return totals


def overlap(a: tuple[float, float], b: tuple[float, float]) -> float:
    return max(0.0, min(a[1], b[1]) - max(a[0], b[0]))


# ----- worker slots -------------------------------------------------------------------------

def running_intervals(events: Iterable[Mapping]) -> list[dict[str, Any]]:
    """Each stretch a task instance spent running on a worker, from Airflow's event log rows
    ({"event", "when", "run_id", "task_id", "map_index", "try_number"}): from a "running" row to
    the next row of the same task instance that leaves running (success, deferred,
    up_for_reschedule, ...). A reschedule-mode sensor runs once per poke, a deferred task once
    before and once after its trigger. Returns {"run_id", "task_id", "start", "end", "ended_as"}
    (epoch seconds); a stretch with no end row yet is left out."""
    rows = sorted(
        ({**row, "_at": epoch(parse_time(row["when"]))} for row in events if row.get("task_id")),
        key=lambda row: row["_at"],
    )
    open_since: dict[tuple, float] = {}
    stretches = []
    for row in rows:
        key = (row.get("run_id"), row["task_id"], row.get("map_index", -1))
        if row["event"] == "running":
            open_since[key] = row["_at"]
        elif row["event"] in LEAVES_RUNNING and key in open_since:
            stretches.append({"run_id": key[0], "task_id": key[1], "start": open_since.pop(key), "end": row["_at"],
                              "ended_as": row["event"]})
    return stretches


def slots_during(stretches: Sequence[Mapping], window: tuple[float, float]) -> float:
    """Worker-slot-seconds that `stretches` held inside `window`."""
    return sum(overlap((s["start"], s["end"]), window) for s in stretches)


def capacity_wait(create_stretches: Sequence[Mapping], ready_at: float | None = None) -> tuple[float, float]:
    """(slot-seconds held waiting for capacity, seconds a blocking wait would hold) for one run's
    create_vm: its stretches that ended deferred found no free machine (or had the insert refused
    for capacity) and held a slot meanwhile; a blocking wait would have held one from its first
    try's start to the start of the stretch that finally went on. A try started on the triggerer
    (CreateVmStartTrigger) waits before its first stretch: given `ready_at` (when create_vm could
    start: the end of the run's last stretch before it), that wait counts for the blocking figure."""
    ordered = sorted(create_stretches, key=lambda s: s["start"])
    if not ordered:
        return 0.0, 0.0
    held = sum(s["end"] - s["start"] for s in ordered if s["ended_as"] == "deferred")
    deferred = [i for i, s in enumerate(ordered) if s["ended_as"] == "deferred"]
    began = ordered[0]["start"] if ready_at is None else min(ready_at, ordered[0]["start"])
    if not deferred:
        return 0.0, ordered[0]["start"] - began
    resumed = ordered[deferred[-1] + 1]["start"] if deferred[-1] + 1 < len(ordered) else ordered[deferred[-1]]["end"]
    return held, resumed - began


# ----- backfill -------------------------------------------------------------------------------

def waves(snapshots: int, capacity: int) -> int:
    """How many rounds of `capacity` VMs `snapshots` runs need at least."""
    return math.ceil(snapshots / capacity)


def unit_idle_gaps(lives: Mapping[str, Mapping], capacity: int) -> list[float]:
    """For each VM that had to wait for a reservation unit (all but the first `capacity` inserts),
    the seconds between the deletion that freed a unit and its insert: the capacity gate's lag."""
    starts = sorted(life["start"] for life in lives.values())
    ends = sorted(life["end"] for life in lives.values() if life["end"] is not None)
    gaps = []
    for i, start in enumerate(starts[capacity:]):
        # The (i+1)-th deletion is the earliest by which a unit was free for the (capacity+i+1)-th VM.
        if i < len(ends) and ends[i] <= start:
            gaps.append(start - ends[i])
    return gaps


# ----- the table ------------------------------------------------------------------------------

def format_table(rows: Sequence[Mapping[str, str]]) -> str:
    """The rows as one GitHub-flavoured Markdown table (readable in a terminal too)."""
    columns = ["figure", "measured", "goal", "met?", "what the rest is spent on"]
    cells = [[str(row.get(c, "")) for c in columns] for row in rows]
    widths = [max(len(c), *(len(r[i]) for r in cells)) if cells else len(c) for i, c in enumerate(columns)]
    line = lambda values: "| " + " | ".join(v.ljust(w) for v, w in zip(values, widths)) + " |"  # noqa: E731
    return "\n".join([line(columns), "|" + "|".join("-" * (w + 2) for w in widths) + "|", *map(line, cells)])


def spent_on(totals: Mapping[str, float], skip: Iterable[str] = ()) -> str:
    """"label 12.3 s, other 4.0 s" for the labels not in `skip`, largest first."""
    skip = set(skip)
    parts = sorted(((v, k) for k, v in totals.items() if k not in skip and v >= 0.05), reverse=True)
    return ", ".join(f"{label} {value:.1f} s" for value, label in parts) or "-"
