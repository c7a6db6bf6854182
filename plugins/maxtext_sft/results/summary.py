"""The run summary: each phase's time and state, the VM's lifetime, VM-hours and estimated cost, the
training's final step and loss, and where the outputs are.

Pure functions of what the tasks left behind (their states, their phase records and XComs), so
tests need no Airflow. A phase record is what `phase_timing.record_phase` pushes for every task
that ran: {"started": first try's start, "ended": ..., "try_number": N, "state": ...}, ISO times.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from typing import Any

from maxtext_sft.run.names import ledger_entry_number, ledger_resumed_name

# XCom key under which a failed task leaves its error (outcome.record_failure), for
# check_run_outcome and the rehearsal's checks to name the cause.
FAILURE_KEY = "failure"
# XCom key of a task's phase record: {"started", "ended", "try_number", "state"} (ISO times, UTC).
PHASE_KEY = "phase"
# XCom key of create_vm: the insert-body fields the cloud refused, without which the VM was made
# (cloud.instances.UNSOURCED_FIELDS' API names, e.g. ["scheduling.maxRunDuration"]; empty: none).
REFUSED_FIELDS_KEY = "refused_fields"
# The instance label the janitor reads (cloud.instances.EXPIRY_LABEL; not imported: no cloud client here).
EXPIRY_LABEL = "expires-at"
# Task states in which create_vm has started at least once, so a VM may have existed.
STARTED_STATES = {"running", "success", "failed", "up_for_retry", "up_for_reschedule", "restarting", "deferred"}
# States of a task that never ran because an earlier one failed (or a user marked the run failed).
NOT_RUN_STATES = {"upstream_failed", "skipped", "removed", None}


@dataclass(frozen=True)
class SummaryTasks:
    """Which task of the DAG plays each part the summary reads, by task id (builders/pipeline.py names them
    from its own task objects)."""

    plan: str  # its XCom "spec" is the run's spec
    create_vm: str
    delete_vm: str
    training: str  # the training sensor: final step and loss
    outputs: str  # collect_outputs: the run record
    publish: str


def _time(text: str | None) -> datetime | None:
    return datetime.fromisoformat(text) if text else None


def _seconds(start: str | None, end: str | None) -> float | None:
    started, ended = _time(start), _time(end)
    return round((ended - started).total_seconds(), 3) if started and ended else None


def phase_rows(
    order: Sequence[str], states: Mapping[str, str | None], records: Mapping[str, dict | None]
) -> list[dict[str, Any]]:
    """One row per task in pipeline order: its state and, if it ran, its first start, its end,
    the time in between (retries and a sensor's reschedules included) and its tries."""
    rows = []
    for task_id in order:
        record = records.get(task_id) or {}
        rows.append({
            "task_id": task_id,
            "state": states.get(task_id) or record.get("state"),
            "started": record.get("started"),
            "ended": record.get("ended"),
            "duration_seconds": _seconds(record.get("started"), record.get("ended")),
            "tries": record.get("try_number"),
        })
    return rows


def vm_usage(
    *,
    created: dict | None,
    create_state: str | None,
    deleted: dict | None,
    instance_created_at: str | None = None,
    instance_started_at: str | None = None,
    delete_state: str | None,
    hourly_price_usd: float | None,
    now: datetime,
    capacity: str | None = None,
    compared_prices_usd: Mapping[str, float | None] | None = None,
) -> dict[str, Any]:
    """The VM's billed lifetime, VM-hours and estimated cost.

    `hourly_price_usd` prices an hour on the run's `capacity` (None: unknown, no cost); with a
    capacity, `compared_prices_usd` ({"reservation": ..., "on-demand": ...}, None or absent when
    not given) prices the same hours on the others. A rehearsal gives no capacity: its CPU VM is on
    demand at its own price, compared with nothing.

    The lifetime runs from the instance's lastStartTimestamp (create_vm's XCom: when it became
    RUNNING, where billing starts), else its creationTimestamp, else create_vm's first start, to
    delete_vm's end: it bounds the VM's billed life from above (the deletion is confirmed before
    the task ends), so the cost is at most this. The timestamps matter because create_vm may have
    waited hours for a free machine before its insert, and a flex-start VM waits PENDING, unbilled,
    between its creation and its start (`waited_for_capacity_seconds`). Without delete_vm's end it
    is counted up to `now`, still an upper bound; unless delete_vm succeeded the VM may still be
    running. If create_vm never started, no VM existed: no lifetime, cost 0.
    """
    usage: dict[str, Any] = {
        "existed": False,
        "started": None,
        "ended": None,
        "deleted": False,
        "lifetime_seconds": None,
        "waited_for_capacity_seconds": None,
        "vm_hours": 0.0,
        "capacity": capacity,
        "hourly_price_usd": hourly_price_usd,
        "estimated_cost_usd": 0.0,
        "cost_on_reservation_usd": None,
        "cost_on_demand_usd": None,
    }
    compared = compared_prices_usd or {}
    if created is None and create_state not in STARTED_STATES:
        return usage | _compared_costs(0.0, compared)  # the run ended before create_vm: no VM, nothing to pay
    usage["existed"] = True
    usage["deleted"] = delete_state == "success"
    if created is None:  # it ran, but left no record (killed before its callback): unknown
        usage.update(vm_hours=None, estimated_cost_usd=None)
        return usage
    # Only a flex-start VM waits between its creation and its start; any other VM's gap is its
    # provisioning (seconds), not a wait for capacity.
    waited = _seconds(instance_created_at, instance_started_at) if capacity == "flex-start" else None
    usage["waited_for_capacity_seconds"] = waited if waited and waited > 0 else None
    usage["started"] = instance_started_at or instance_created_at or created["started"]
    usage["ended"] = deleted["ended"] if usage["deleted"] and deleted else now.isoformat()
    seconds = _seconds(usage["started"], usage["ended"])
    usage["lifetime_seconds"] = seconds
    usage["vm_hours"] = round(seconds / 3600, 4)
    usage["estimated_cost_usd"] = _cost(seconds / 3600, hourly_price_usd)
    return usage | _compared_costs(seconds / 3600, compared)


def _cost(hours: float, price: float | None) -> float | None:
    return round(hours * price, 2) if price is not None else None


def _compared_costs(hours: float, compared: Mapping[str, float | None]) -> dict[str, float | None]:
    """What the same hours would have cost on a reservation and on demand (None: price not given)."""
    return {
        "cost_on_reservation_usd": _cost(hours, compared.get("reservation")),
        "cost_on_demand_usd": _cost(hours, compared.get("on-demand")),
    }


def recovery_rows(ledger: Mapping[str, Mapping[str, Any]]) -> list[dict[str, Any]]:
    """One row per recovery of the run's ledger (vm_recovery: N.json, and N-resumed.json once its
    training resumed): when and why (`preempted`: the VM was lost to a Spot preemption), the steps
    lost (trained on the lost VM after the checkpoint the new one resumed from), and the VM-minutes
    from the new VM's insert to the resumed training."""
    rows = []
    for name, entry in sorted(ledger.items()):
        if ledger_entry_number(name) is None:
            continue
        number = entry.get("recovery")
        resumed = ledger.get(ledger_resumed_name(number)) or {}
        lost, kept = entry.get("lost_after_step"), entry.get("resumes_after_step") or 0
        at, resumed_at = entry.get("at"), resumed.get("resumed_at")
        rows.append({
            "recovery": number,
            "at": datetime.fromtimestamp(at, timezone.utc).isoformat() if at else None,
            "reason": entry.get("reason"),
            "preempted": bool(entry.get("preempted")),
            "resumes_after_step": entry.get("resumes_after_step"),
            "steps_lost": max(0, lost - kept) if lost is not None else None,
            "vm_minutes_to_resume": round((resumed_at - at) / 60, 2) if at and resumed_at else None,
            "step_seconds": resumed.get("step_seconds"),
        })
    return sorted(rows, key=lambda row: row["recovery"] or 0)


def backstops(
    spec: Mapping[str, Any] | None, instance: Mapping[str, Any] | None, refused: Sequence[str] | None
) -> dict[str, dict[str, Any]] | None:
    """What ends the VM if the run's teardown never does, as they stood for this run: the
    cloud-enforced lifetime (the instance's scheduling.maxRunDuration with its termination action,
    as create_vm's XCom `instance` shows it: absent if the cloud refused it, `refused` says so),
    the VM's autostop watchdog (it stops itself when idle) and the janitor DAG (it deletes a VM
    past its expiry label). None without a spec (no VM was planned)."""
    if not spec:
        return None
    instance = instance if isinstance(instance, Mapping) else None  # a slice's create returns its hosts
    scheduling = (instance or {}).get("scheduling") or {}
    duration = scheduling.get("max_run_duration") or {}
    seconds = int(duration.get("seconds") or 0) or None
    if seconds:
        why = None
    elif refused and "scheduling.maxRunDuration" in refused:
        why = "Compute Engine refused scheduling.maxRunDuration with this provisioning model: the VM was made without it"
    elif spec.get("tpu_slice"):
        why = "none on a slice's hosts (the group would re-create a host the limit deleted)"
    elif not spec.get("cloud_enforced_lifetime", True):
        why = "cloud_enforced_lifetime is off"
    elif instance is None:
        why = "unknown (create_vm left no instance)"
    else:
        why = "the VM has none"
    expires = ((instance or {}).get("labels") or {}).get(EXPIRY_LABEL)
    return {
        "cloud_lifetime": {
            "in_force": bool(seconds),
            "max_run_duration_seconds": seconds,
            "termination_action": scheduling.get("instance_termination_action") if seconds else None,
            "why_not": why,
        },
        "autostop": {"in_force": True, "idle_minutes": spec.get("autostop_idle_minutes")},
        "janitor": {
            "in_force": bool(expires),
            "expires_at": (
                datetime.fromtimestamp(int(expires), timezone.utc).isoformat() if expires and expires.isdigit() else None
            ),
        },
    }


def backstops_text(found: Mapping[str, Mapping[str, Any]]) -> str:
    """The backstops' line in the summary's text."""
    lifetime, autostop, janitor = found["cloud_lifetime"], found["autostop"], found["janitor"]
    parts = [
        f"cloud-enforced lifetime {format_duration(lifetime['max_run_duration_seconds'])} "
        f"({lifetime['termination_action']})" if lifetime["in_force"] else f"no cloud-enforced lifetime ({lifetime['why_not']})",
        f"the VM's autostop after {autostop['idle_minutes']:g} idle minutes" if autostop["idle_minutes"] else "the VM's autostop",
        f"the janitor DAG after {_clock(janitor['expires_at'])} (its expiry label), when it runs"
        if janitor["expires_at"] else "no expiry label for the janitor DAG",
    ]
    return "Backstops if the teardown never runs: " + "; ".join(parts)


def build_summary(
    *,
    dag_id: str,
    run_id: str,
    order: Sequence[str],
    states: Mapping[str, str | None],
    records: Mapping[str, dict | None],
    spec: Mapping[str, Any] | None,
    training: Mapping[str, Any] | None,
    record: Mapping[str, Any] | None,
    published: Mapping[str, Any] | None,
    hourly_price_usd: float | None,
    now: datetime,
    tasks: SummaryTasks,
    capacity: str | None = None,
    compared_prices_usd: Mapping[str, float | None] | None = None,
    recoveries: Sequence[Mapping[str, Any]] = (),
    instance_created_at: str | None = None,
    instance_started_at: str | None = None,
    rehearsal_checks: Sequence[Mapping[str, str]] | None = None,
    backstops: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """The summary as a dict (the task's XCom, run-summary.json). Only named fields are copied
    from the spec, the training's result and the run record: nothing else of theirs can leak in."""
    phases = phase_rows(order, states, records)
    # A phase without times shows "-" (the scheduler's no-op vm_lease never runs anywhere); only
    # what the VM's cost and the outputs depend on is worth a warning when it is missing.
    warnings = []
    for task_id in (tasks.create_vm, tasks.delete_vm):
        if states.get(task_id) in STARTED_STATES and not records.get(task_id):
            warnings.append(f"{task_id} ran ({states[task_id]}) but left no phase record: the VM's lifetime is unknown")
    not_succeeded = {row["task_id"]: row["state"] for row in phases if row["state"] != "success"}
    vm = vm_usage(
        created=records.get(tasks.create_vm),
        create_state=states.get(tasks.create_vm),
        deleted=records.get(tasks.delete_vm),
        instance_created_at=instance_created_at,
        instance_started_at=instance_started_at,
        delete_state=states.get(tasks.delete_vm),
        hourly_price_usd=hourly_price_usd,
        now=now,
        capacity=capacity,
        compared_prices_usd=compared_prices_usd,
    )
    if vm["existed"] and not vm["deleted"]:
        warnings.append(f"{tasks.delete_vm} did not confirm the deletion: the VM may still exist (counted up to now)")
    if states.get(tasks.outputs) == "success" and not record:
        warnings.append(f"{tasks.outputs} succeeded but its run record was not found")
    if states.get(tasks.training) == "success" and not training:
        warnings.append(f"{tasks.training} succeeded but its final step and loss were not found")
    outputs = None
    if record:
        outputs = {
            key: record.get(key)
            for key in ("run_record", "hf_export", "model_card", "checkpoints", "loss_curve", "base_checkpoint")
        }
    return {
        "dag_id": dag_id,
        "run_id": run_id,
        "run_name": (spec or {}).get("run_name"),
        "vm_name": (spec or {}).get("vm_name"),
        "outcome": "success" if not not_succeeded else "failed",
        "not_succeeded": not_succeeded,
        "phases": phases,
        "vm": vm,
        "final_step": (training or {}).get("final_step"),
        "final_loss": (training or {}).get("final_loss"),
        # The held-out evaluation, from the run record: {"base": ..., "tuned": ...} and its split.
        "eval_split": (record or {}).get("eval_split"),
        "eval_loss": (record or {}).get("eval_loss"),
        "outputs": outputs,
        "published": dict(published) if published else None,
        "recoveries": [dict(row) for row in recoveries],
        "preemptions": sum(1 for row in recoveries if row.get("preempted")),
        "backstops": dict(backstops) if backstops else None,
        **({"rehearsal_checks": [dict(row) for row in rehearsal_checks]} if rehearsal_checks is not None else {}),
        "tasks": asdict(tasks),
        "warnings": warnings,
        "summarized_at": now.isoformat(),
    }


def format_duration(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    if seconds < 10:
        return f"{seconds:.1f}s"
    whole = round(seconds)
    hours, rest = divmod(whole, 3600)
    minutes, secs = divmod(rest, 60)
    if hours:
        return f"{hours}h {minutes:02d}m {secs:02d}s"
    return f"{minutes}m {secs:02d}s" if minutes else f"{secs}s"


def capacity_wait_text(seconds: Any) -> str | None:
    """The VM's unbilled wait for capacity in words, when it waited more than a second (the
    summary's text, the Fine-tunes page); None otherwise."""
    if not isinstance(seconds, (int, float)) or seconds <= 1:
        return None
    return f"waited {format_duration(seconds)} for capacity (not billed)"


def _clock(text: str) -> str:
    """An ISO time as the log shows it: UTC, to the second."""
    return f"{datetime.fromisoformat(text).astimezone(timezone.utc):%Y-%m-%d %H:%M:%S}"


def render_text(summary: Mapping[str, Any]) -> str:
    """The summary for the task log: one line per phase, then the VM, the training and the outputs."""
    verdict = summary["outcome"]
    if summary["not_succeeded"]:
        named = [f"{t}={s}" for t, s in summary["not_succeeded"].items() if s not in NOT_RUN_STATES]
        not_run = len(summary["not_succeeded"]) - len(named)
        verdict += " (" + ", ".join(named + ([f"{not_run} did not run"] if not_run else [])) + ")"
    lines = [f"Run summary of {summary['dag_id']} / {summary['run_id']}: {verdict}", "Phases (UTC):"]
    width = max((len(row["task_id"]) for row in summary["phases"]), default=0)
    for row in summary["phases"]:
        tries = f"{row['tries']} tries" if (row["tries"] or 0) > 1 else ""
        when = f"{_clock(row['started'])} -> {_clock(row['ended'])}" if row["started"] and row["ended"] else ""
        lines.append(
            f"  {row['task_id']:<{width}}  {str(row['state']):<15} {format_duration(row['duration_seconds']):>11}"
            f"  {tries:<8}  {when}".rstrip()
        )
    vm = summary["vm"]
    create, delete, outputs = (summary["tasks"][part] for part in ("create_vm", "delete_vm", "outputs"))
    name = summary["vm_name"] or "the VM"
    if not vm["existed"]:
        lines.append(f"VM: none was created ({create} did not run); estimated cost $0.00")
    elif vm["lifetime_seconds"] is None:
        lines.append(f"VM {name}: lifetime unknown ({create} left no phase record); cost not estimated")
    else:
        span = (
            f"at most: {create}'s start to {delete}'s end" if vm["deleted"]
            else f"so far: {create}'s start to now, deletion not confirmed"
        )
        cost = "not estimated (no price)" if vm["estimated_cost_usd"] is None else (
            f"${vm['estimated_cost_usd']:.2f} at ${vm['hourly_price_usd']:.2f}/hour"
        )
        if vm.get("capacity"):
            cost = _capacity_costs(vm, cost)
        wait = capacity_wait_text(vm.get("waited_for_capacity_seconds"))
        lines.append(
            f"VM {name}: lifetime {format_duration(vm['lifetime_seconds'])} ({span}), "
            f"{vm['vm_hours']:.3f} VM-hours, estimated cost {cost}" + (f"; {wait}" if wait else "")
        )
    if summary.get("backstops") and vm["existed"]:
        lines.append(backstops_text(summary["backstops"]))
    for row in summary.get("recoveries") or ():
        lost = "steps lost unknown" if row["steps_lost"] is None else f"{row['steps_lost']} steps lost"
        minutes = "" if row["vm_minutes_to_resume"] is None else f", {row['vm_minutes_to_resume']:.1f} VM-minutes to resume"
        lines.append(
            f"{'Preemption' if row.get('preempted') else 'Recovery'} {row['recovery']} at {_clock(row['at']) if row['at'] else '?'}: resumed after step "
            f"{row['resumes_after_step']}, {lost}{minutes}; {row['reason']}"
        )
    if summary["final_step"] is None:
        lines.append("Training: no final step or loss (the training did not finish)")
    else:
        lines.append(f"Training: final step {summary['final_step']}, final loss {summary['final_loss']}")
    if summary.get("eval_split") and summary.get("eval_loss"):
        loss = summary["eval_loss"]
        shown = {k: "not measured" if loss.get(k) is None else f"{loss[k]:.4f}" for k in ("base", "tuned")}
        lines.append(f"Held-out eval loss on {summary['eval_split']}: base {shown['base']}, tuned {shown['tuned']}")
    if summary["outputs"]:
        lines.append("Outputs:")
        lines += [f"  {key}: {value}" for key, value in summary["outputs"].items() if value]
    else:
        lines.append(f"Outputs: none recorded ({outputs} did not succeed)")
    if summary["published"]:
        published = summary["published"]
        if published.get("published", True):  # a run summarized before the gate returned no flag
            lines.append(
                f"Published: {published.get('repo_id')}@{published.get('branch')} commit {published.get('commit')}"
            )
        else:
            lines.append(f"Not published: {published.get('reason')}")
    if summary.get("rehearsal_checks") is not None:
        lines += render_checks(summary["rehearsal_checks"])
    lines += [f"Warning: {warning}" for warning in summary["warnings"]]
    return "\n".join(lines)


def _capacity_costs(vm: Mapping[str, Any], cost: str) -> str:
    """The cost's words with the capacity named, and the same hours on a reservation and on demand."""
    capacity = vm["capacity"]
    if vm["estimated_cost_usd"] is None:
        cost = f"not estimated (no {capacity} price given)"
    else:
        cost += f" ({capacity})"
    others = [
        f"price {words} not given" if vm.get(key) is None else f"${vm[key]:.2f} {words}"
        for other, key, words in (
            ("reservation", "cost_on_reservation_usd", "on a reservation"),
            ("on-demand", "cost_on_demand_usd", "on demand"),
        )
        if other != capacity
    ]
    return f"{cost}; the same hours: {', '.join(others)}"


def render_checks(rows: Sequence[Mapping[str, str]]) -> list[str]:
    """The checks' lines in the run summary's text."""
    width = max((len(row["check"]) for row in rows), default=0)
    lines = ["Rehearsal checks:"]
    for row in rows:
        lines.append(f"  {row['result']:<8} {row['check']:<{width}}  {row['detail'] or row['proves']}")
    return lines
