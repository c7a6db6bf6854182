"""The run summary built from task states and phase records (pure functions, no Airflow)."""

from __future__ import annotations

import json
import re
from datetime import datetime, timedelta, timezone

import pytest

from maxtext_sft.results.summary import SummaryTasks, build_summary, format_duration, recovery_rows, render_text, vm_usage

T0 = datetime(2026, 11, 30, 10, 0, tzinfo=timezone.utc)
NOW = T0 + timedelta(hours=3)

# The pipeline's tasks in the order its summary lists them (tests/dags/test_maxtext_sft_dag.py
# checks that order on the DAG itself).
PHASES = [
    "plan_run", "preflight", "vm_lease", "create_vm", "wait_for_ssh", "install_maxtext", "convert_checkpoint",
    "start_training", "wait_for_final_checkpoint", "export_to_hf", "collect_outputs", "delete_vm", "publish_to_hub",
]
TASKS = SummaryTasks(
    plan="plan_run", create_vm="create_vm", delete_vm="delete_vm", training="wait_for_final_checkpoint",
    outputs="collect_outputs", publish="publish_to_hub",
)


def at(minutes: float) -> str:
    return (T0 + timedelta(minutes=minutes)).isoformat()


def phase(start: float, end: float, tries: int = 1, state: str = "success") -> dict:
    return {"started": at(start), "ended": at(end), "try_number": tries, "state": state}


def happy_records() -> dict:
    return {
        "plan_run": phase(0, 0.5),
        "preflight": phase(0.5, 1),
        "create_vm": phase(1, 4, tries=2),  # the first try's start: retries are in the phase
        "wait_for_ssh": phase(4, 5),
        "install_maxtext": phase(5, 6),
        "convert_checkpoint": phase(6, 10),
        "start_training": phase(10, 10.5),
        "wait_for_final_checkpoint": phase(10.5, 70.5),  # every reschedule in between
        "export_to_hf": phase(70.5, 80),
        "collect_outputs": phase(80, 81),
        "delete_vm": phase(81, 91),
        "publish_to_hub": phase(81, 85),
    }


SPEC = {"run_name": "2026-11-30-10-00-00-abc-g0", "vm_name": "maxtext-sft-abc-g0",
        "ssh_public_key": "ssh-ed25519 AAAA-CANARY", "vm_hourly_price_usd": 20.0}
RECORD = {
    "run_record": "gs://b/p/runs/R/run-record.json", "hf_export": "gs://b/p/runs/R/hf-export",
    "model_card": "gs://b/p/runs/R/hf-export/README.md", "checkpoints": "gs://b/p/runs/R/checkpoints",
    "loss_curve": "gs://b/p/runs/R/loss-curve.png", "base_checkpoint": "gs://b/p/base/0/items",
    "loss_history": [[1, 2.0], [2, 1.5]], "unexpected": "CANARY",
}


TRAINING = {"final_step": 1000, "final_loss": "0.812"}


def summary(states: dict, records: dict, *, price: float | None = 20.0, record=RECORD, training=TRAINING, spec=SPEC):
    return build_summary(
        dag_id="maxtext_sft", run_id="manual__r", order=PHASES, states=states, records=records, spec=spec,
        training=training, record=record, published=None, hourly_price_usd=price, now=NOW, tasks=TASKS,
    )


def test_phases_keep_pipeline_order_with_durations_that_include_retries_and_reschedules():
    training = {"final_step": 1000, "final_loss": "0.812", "final_checkpoint": "x"}
    result = summary({t: "success" for t in PHASES}, happy_records(), training=training)
    assert [row["task_id"] for row in result["phases"]] == PHASES
    rows = {row["task_id"]: row for row in result["phases"]}
    assert rows["create_vm"]["duration_seconds"] == 180 and rows["create_vm"]["tries"] == 2
    assert rows["wait_for_final_checkpoint"]["duration_seconds"] == 3600
    assert rows["vm_lease"] == {"task_id": "vm_lease", "state": "success", "started": None, "ended": None,
                                "duration_seconds": None, "tries": None}  # the scheduler's no-op: never ran
    assert result["outcome"] == "success" and result["not_succeeded"] == {}
    assert (result["final_step"], result["final_loss"]) == (1000, "0.812")
    assert result["outputs"]["loss_curve"] == "gs://b/p/runs/R/loss-curve.png"
    assert result["outputs"]["run_record"] == "gs://b/p/runs/R/run-record.json"
    assert result["warnings"] == []


def test_vm_lifetime_runs_from_the_creates_start_to_the_deletes_end_and_costs_hours_times_price():
    result = summary({t: "success" for t in PHASES}, happy_records(), price=36.0)
    vm = result["vm"]
    assert vm["existed"] and vm["deleted"]
    assert (vm["started"], vm["ended"]) == (at(1), at(91))
    assert vm["lifetime_seconds"] == 90 * 60
    assert vm["vm_hours"] == 1.5
    assert vm["estimated_cost_usd"] == 54.0
    assert vm["hourly_price_usd"] == 36.0


def test_a_run_that_failed_before_the_vm_existed_has_no_lifetime_and_costs_nothing():
    states = {t: "upstream_failed" for t in PHASES} | {"plan_run": "success", "preflight": "failed"}
    records = {"plan_run": phase(0, 0.5), "preflight": phase(0.5, 1, state="failed")}
    result = summary(states, records, record=None, training=None)
    vm = result["vm"]
    assert vm["existed"] is False
    assert vm["lifetime_seconds"] is None and vm["vm_hours"] == 0 and vm["estimated_cost_usd"] == 0
    assert result["outcome"] == "failed" and result["not_succeeded"]["preflight"] == "failed"
    assert result["outputs"] is None
    assert result["warnings"] == []
    text = render_text(result)
    assert "VM: none was created" in text and "$0.00" in text
    assert text.splitlines()[0].endswith("failed (preflight=failed, 11 did not run)")
    # Even plan_run failing leaves no spec, no price: still no cost.
    no_spec = summary({"plan_run": "failed"}, {"plan_run": phase(0, 0.2, state="failed")}, price=None, spec=None,
                      record=None)
    assert no_spec["vm"]["estimated_cost_usd"] == 0 and no_spec["run_name"] is None


def test_a_delete_that_did_not_succeed_counts_the_vm_up_to_now_and_warns():
    records = happy_records() | {"delete_vm": phase(81, 95, tries=6, state="failed")}
    states = {t: "success" for t in PHASES} | {"delete_vm": "failed"}
    vm = summary(states, records)["vm"]
    assert vm["deleted"] is False and vm["ended"] == NOW.isoformat()
    assert vm["lifetime_seconds"] == (NOW - T0).total_seconds() - 60
    assert vm["estimated_cost_usd"] == round(vm["lifetime_seconds"] / 3600 * 20, 2)
    result = summary(states, records)
    assert any("may still exist" in warning for warning in result["warnings"])
    assert "so far: create_vm's start to now, deletion not confirmed" in render_text(result)


def test_a_create_that_ran_without_a_phase_record_leaves_the_cost_unknown_not_zero():
    records = {k: v for k, v in happy_records().items() if k != "create_vm"}
    result = summary({t: "success" for t in PHASES} | {"create_vm": "failed"}, records)
    assert result["vm"]["existed"] and result["vm"]["estimated_cost_usd"] is None
    assert result["warnings"] == ["create_vm ran (failed) but left no phase record: the VM's lifetime is unknown"]
    assert "lifetime unknown" in render_text(result)


def test_only_named_fields_reach_the_summary():
    result = summary({t: "success" for t in PHASES}, happy_records(), training={"final_step": 3, "secret": "CANARY"})
    assert "CANARY" not in json.dumps(result) and "CANARY" not in render_text(result)
    assert "loss_history" not in json.dumps(result)  # the record's history stays in the record


def test_the_text_has_a_line_per_phase_the_vm_training_and_outputs():
    text = render_text(summary({t: "success" for t in PHASES}, happy_records()))
    assert text.splitlines()[0] == "Run summary of maxtext_sft / manual__r: success"
    assert re.search(r"create_vm +success +3m 00s  2 tries   2026-11-30 10:01:00 -> 2026-11-30 10:04:00", text)
    assert "wait_for_final_checkpoint" in text and "1h 00m 00s" in text
    assert "lifetime 1h 30m 00s (at most: create_vm's start to delete_vm's end), 1.500 VM-hours" in text
    assert "estimated cost $30.00 at $20.00/hour" in text
    assert "final step 1000, final loss 0.812" in text
    assert "loss_curve: gs://b/p/runs/R/loss-curve.png" in text


@pytest.mark.parametrize(("seconds", "text"), [
    (None, "-"), (0.25, "0.2s"), (42, "42s"), (61, "1m 01s"), (3 * 3600 + 5, "3h 00m 05s"),
])
def test_durations_read_as_hours_minutes_seconds(seconds, text):
    assert format_duration(seconds) == text


def test_vm_usage_without_a_price_says_so():
    usage = vm_usage(created=phase(0, 1), create_state="success", deleted=phase(60, 120), delete_state="success",
                     hourly_price_usd=None, now=NOW)
    assert usage["vm_hours"] == 2.0 and usage["estimated_cost_usd"] is None


def test_the_vm_is_counted_from_its_creation_not_from_a_create_that_waited_for_capacity():
    # create_vm started at minute 0, waited for a free machine, and inserted at minute 45.
    usage = vm_usage(created=phase(0, 46), create_state="success", deleted=phase(100, 105), delete_state="success",
                     hourly_price_usd=20.0, now=NOW, instance_created_at=at(45))
    assert usage["started"] == at(45) and usage["lifetime_seconds"] == 60 * 60
    assert usage["estimated_cost_usd"] == 20.0


def test_each_recovery_is_listed_with_when_why_steps_lost_and_vm_minutes():
    at = int(T0.timestamp())
    ledger = {
        "1.json": {"recovery": 1, "reason": "VM x no longer exists", "resumes_after_step": 300,
                   "lost_after_step": 342, "at": at},
        "1-resumed.json": {"recovery": 1, "resumed_at": at + 750, "step_seconds": {"install": 400.0}},
        "2.json": {"recovery": 2, "reason": "VM x has answered no SSH for 600 s", "resumes_after_step": None,
                   "lost_after_step": None, "at": at + 3600},  # its training has not resumed yet
        "notes.txt.json": {"recovery": 9},  # not a ledger entry
    }
    rows = recovery_rows(ledger)
    assert [row["recovery"] for row in rows] == [1, 2]
    assert rows[0] == {"recovery": 1, "at": at_iso(0), "reason": "VM x no longer exists", "preempted": False,
                       "resumes_after_step": 300, "steps_lost": 42, "vm_minutes_to_resume": 12.5,
                       "step_seconds": {"install": 400.0}}
    assert rows[1]["steps_lost"] is None and rows[1]["vm_minutes_to_resume"] is None

    result = build_summary(
        dag_id="maxtext_sft", run_id="manual__r", order=PHASES, states={t: "success" for t in PHASES},
        records=happy_records(), spec=SPEC, training=TRAINING, record=RECORD, published=None, hourly_price_usd=20.0,
        now=NOW, tasks=TASKS, recoveries=rows,
    )
    assert result["recoveries"] == rows
    text = render_text(result)
    assert "Recovery 1 at 2026-11-30 10:00:00: resumed after step 300, 42 steps lost, 12.5 VM-minutes to resume; " \
           "VM x no longer exists" in text
    assert "Recovery 2 at 2026-11-30 11:00:00: resumed after step None, steps lost unknown;" in text


def at_iso(minutes: float) -> str:
    return datetime.fromtimestamp((T0 + timedelta(minutes=minutes)).timestamp(), timezone.utc).isoformat()


def test_a_vm_that_waited_pending_for_capacity_is_billed_from_its_start():
    # A flex-start VM: created at minute 1 (PENDING), RUNNING at minute 31, deleted by minute 91.
    usage = vm_usage(created=phase(0, 32), create_state="success", deleted=phase(85, 91), delete_state="success",
                     hourly_price_usd=20.0, now=NOW, instance_created_at=at(1), instance_started_at=at(31),
                     capacity="flex-start")
    assert usage["started"] == at(31) and usage["lifetime_seconds"] == 60 * 60
    assert usage["waited_for_capacity_seconds"] == 30 * 60
    assert (usage["vm_hours"], usage["estimated_cost_usd"]) == (1.0, 20.0)
    result = build_summary(
        dag_id="maxtext_sft", run_id="manual__r", order=PHASES, states={t: "success" for t in PHASES},
        records=happy_records(), spec=SPEC, training=TRAINING, record=RECORD, published=None, hourly_price_usd=20.0,
        now=NOW, tasks=TASKS, instance_created_at=at(1), instance_started_at=at(31), capacity="flex-start",
    )
    assert result["vm"]["waited_for_capacity_seconds"] == 30 * 60
    assert "waited 30m 00s for capacity (not billed)" in render_text(result)
    # Another capacity's gap between creation and start is its provisioning: billed from the start, no wait named.
    usage = vm_usage(created=phase(0, 32), create_state="success", deleted=phase(85, 91), delete_state="success",
                     hourly_price_usd=20.0, now=NOW, instance_created_at=at(1), instance_started_at=at(31),
                     capacity="reservation")
    assert usage["started"] == at(31) and usage["waited_for_capacity_seconds"] is None


@pytest.mark.parametrize(("created", "started", "waited"), [
    (None, None, None), (at(1), None, None), (None, at(1), None),  # one time alone: no wait known
    (at(1), at(1), None), (at(2), at(1), None),  # no wait, or clocks out of order
])
def test_no_wait_for_capacity_unless_the_start_is_after_the_creation(created, started, waited):
    usage = vm_usage(created=phase(0, 5), create_state="success", deleted=phase(60, 61), delete_state="success",
                     hourly_price_usd=20.0, now=NOW, instance_created_at=created, instance_started_at=started)
    assert usage["waited_for_capacity_seconds"] is waited
    assert usage["started"] == (started or created or at(0))
    result = summary({t: "success" for t in PHASES}, happy_records())
    assert result["vm"]["waited_for_capacity_seconds"] is None and "for capacity" not in render_text(result)


def test_a_wait_of_a_second_or_less_is_not_worth_a_word():
    usage = vm_usage(created=phase(0, 5), create_state="success", deleted=phase(60, 61), delete_state="success",
                     hourly_price_usd=20.0, now=NOW, instance_created_at=at(1), instance_started_at=at(1 + 0.5 / 60),
                     capacity="flex-start")
    assert usage["waited_for_capacity_seconds"] == 0.5
    result = summary({t: "success" for t in PHASES}, happy_records())
    result["vm"] = usage
    assert "for capacity" not in render_text(result)


def priced(capacity: str | None, price: float | None, reservation: float | None, on_demand: float | None) -> dict:
    """The summary of the happy run (1.5 billed hours) on `capacity` at `price` an hour."""
    return build_summary(
        dag_id="maxtext_sft", run_id="manual__r", order=PHASES, states={t: "success" for t in PHASES},
        records=happy_records(), spec=SPEC, training=TRAINING, record=RECORD, published=None, hourly_price_usd=price,
        now=NOW, tasks=TASKS, capacity=capacity, compared_prices_usd={"reservation": reservation, "on-demand": on_demand},
    )


def test_a_spot_run_is_priced_at_spot_and_compared_with_a_reservation_and_on_demand():
    result = priced("spot", 6.0, 20.0, None)
    vm = result["vm"]
    assert (vm["capacity"], vm["hourly_price_usd"], vm["estimated_cost_usd"]) == ("spot", 6.0, 9.0)
    assert (vm["cost_on_reservation_usd"], vm["cost_on_demand_usd"]) == (30.0, None)
    assert "1.500 VM-hours, estimated cost $9.00 at $6.00/hour (spot); the same hours: $30.00 on a reservation, " \
           "price on demand not given" in render_text(result)


def test_a_run_on_its_reservation_is_compared_with_on_demand_only():
    vm = priced("reservation", 20.0, 20.0, 30.0)["vm"]
    assert (vm["estimated_cost_usd"], vm["cost_on_reservation_usd"], vm["cost_on_demand_usd"]) == (30.0, 30.0, 45.0)
    assert "estimated cost $30.00 at $20.00/hour (reservation); the same hours: $45.00 on demand\n" \
        in render_text(priced("reservation", 20.0, 20.0, 30.0))
    on_demand = render_text(priced("on-demand", 30.0, 20.0, 30.0))
    assert "estimated cost $45.00 at $30.00/hour (on-demand); the same hours: $30.00 on a reservation\n" in on_demand


def test_a_capacity_without_a_price_has_no_cost_but_still_the_comparison():
    result = priced("flex-start", None, 20.0, None)
    assert result["vm"]["estimated_cost_usd"] is None and result["vm"]["cost_on_reservation_usd"] == 30.0
    assert "estimated cost not estimated (no flex-start price given); the same hours: $30.00 on a reservation, " \
           "price on demand not given" in render_text(result)


def test_without_a_capacity_a_rehearsal_keeps_one_price_and_no_comparison():
    result = summary({t: "success" for t in PHASES}, happy_records(), price=0.27)
    vm = result["vm"]
    assert vm["capacity"] is None and vm["cost_on_reservation_usd"] is None and vm["cost_on_demand_usd"] is None
    assert "estimated cost $0.41 at $0.27/hour\n" in render_text(result)


def test_a_run_that_never_had_a_vm_costs_nothing_on_any_capacity():
    states = {t: "upstream_failed" for t in PHASES} | {"plan_run": "success", "preflight": "failed"}
    vm = build_summary(
        dag_id="maxtext_sft", run_id="manual__r", order=PHASES, states=states, records={"plan_run": phase(0, 0.5)},
        spec=SPEC, training=None, record=None, published=None, hourly_price_usd=6.0, now=NOW, tasks=TASKS,
        capacity="spot", compared_prices_usd={"reservation": 20.0, "on-demand": None},
    )["vm"]
    assert (vm["estimated_cost_usd"], vm["cost_on_reservation_usd"], vm["cost_on_demand_usd"]) == (0.0, 0.0, None)


def test_a_preemption_is_told_as_such_and_counted():
    at = int(T0.timestamp())
    ledger = {
        "1.json": {"recovery": 1, "reason": "VM x was preempted", "preempted": True, "resumes_after_step": 200,
                   "lost_after_step": 230, "at": at},
        "1-resumed.json": {"recovery": 1, "resumed_at": at + 600},
        "2.json": {"recovery": 2, "reason": "VM x has answered no SSH for 600 s", "resumes_after_step": 400,
                   "lost_after_step": 400, "at": at + 3600},
        "3.json": {"recovery": 3, "reason": "VM x was preempted", "preempted": True, "resumes_after_step": 500,
                   "lost_after_step": 510, "at": at + 7200},
    }
    rows = recovery_rows(ledger)
    assert [row["preempted"] for row in rows] == [True, False, True]
    result = build_summary(
        dag_id="maxtext_sft", run_id="manual__r", order=PHASES, states={t: "success" for t in PHASES},
        records=happy_records(), spec=SPEC, training=TRAINING, record=RECORD, published=None, hourly_price_usd=20.0,
        now=NOW, tasks=TASKS, recoveries=rows,
    )
    assert result["preemptions"] == 2
    text = render_text(result)
    assert "Preemption 1 at 2026-11-30 10:00:00: resumed after step 200, 30 steps lost, 10.0 VM-minutes to resume; " \
           "VM x was preempted" in text
    assert "Recovery 2 at 2026-11-30 11:00:00: resumed after step 400, 0 steps lost;" in text
    assert "Preemption 3 at 2026-11-30 12:00:00: resumed after step 500, 10 steps lost;" in text
    assert summary({t: "success" for t in PHASES}, happy_records())["preemptions"] == 0
