"""bench/recovery_slots.py's arithmetic: a recovery's waits from its ledger, and the worker-slot
seconds the run's task stretches held inside each."""

from __future__ import annotations

from bench.recovery_slots import recovery_waits, report, slots_in_waits

LEDGER = {
    "1.json": {"recovery": 1, "capacity_wait": [100.0, 160.0], "at": 161.0},
    "1-resumed.json": {"recovery": 1, "resumed_at": 250,
                       "step_seconds": {"wait_for_ssh": 70.0, "install": 10.0, "convert": 15.0, "start_training": 5.0}},
    "2.json": {"recovery": 2, "capacity_wait": None, "at": 400.0},  # a machine was free; not resumed yet
}


def stretch(start, end, ended_as="up_for_reschedule"):
    return {"run_id": "r", "task_id": "wait_for_final_checkpoint", "start": start, "end": end, "ended_as": ended_as}


def test_the_waits_come_from_the_ledger():
    first, second = recovery_waits(LEDGER)
    assert first == {"recovery": 1, "capacity": (100.0, 160.0), "ssh": (161.0, 220.0)}  # resumed_at - the re-run steps
    assert second == {"recovery": 2, "capacity": None, "ssh": None}


def test_a_deferred_wait_holds_nothing_inside_only_its_bookends():
    stretches = [stretch(98, 101, "deferred"), stretch(159, 163), stretch(180, 182), stretch(200, 201)]
    [row, _] = slots_in_waits(recovery_waits(LEDGER), stretches)
    assert row["capacity_wait_seconds"] == 60.0
    assert row["capacity_slot_seconds_inside"] == 0 and row["capacity_stretches_inside"] == 0
    assert row["capacity_slot_seconds"] == 2.0  # 100-101 and 159-160: the try that deferred, the one that went on
    assert row["ssh_stretches_inside"] == 2 and row["ssh_slot_seconds"] == 5.0  # 161-163, 180-182, 200-201


def test_pokes_while_waiting_for_a_machine_are_counted():
    """What a reschedule-mode wait would hold: a poke every so often, each on a worker."""
    stretches = [stretch(98, 101), stretch(120, 122), stretch(140, 143), stretch(159, 163)]
    [row, _] = slots_in_waits(recovery_waits(LEDGER), stretches)
    assert row["capacity_stretches_inside"] == 2 and row["capacity_slot_seconds_inside"] == 5.0
    assert "held while waiting: 5.00 (2 task stretches)" in report([row])


def test_no_recovery_says_so():
    assert report(slots_in_waits(recovery_waits({}), [])) == "This run made no VM recovery."
