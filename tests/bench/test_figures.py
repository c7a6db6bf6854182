"""The bench's arithmetic on small samples shaped like what it reads (no cloud, no Airflow)."""

from __future__ import annotations

import pytest

from bench import figures

T0 = "2026-12-01T10:00:00.000Z"


def at(seconds: float) -> str:
    """An RFC 3339 time `seconds` after T0, as the emulator writes it (ms, Z)."""
    whole, frac = divmod(seconds, 1)
    return f"2026-12-01T10:{int(whole) // 60:02d}:{int(whole) % 60:02d}.{round(frac * 1000):03d}Z"


def epoch(seconds: float) -> float:
    return figures.epoch(figures.parse_time(T0)) + seconds


def insert_post(name, seconds, request_id, status=200):
    return {"time": at(seconds), "method": "POST", "path": "/compute/v1/projects/p/zones/z/instances",
            "query": {"requestId": request_id}, "body": {"name": name}, "status": status}


def operation(kind, name, inserted, ended, request_id=None, error=False):
    op = {"operationType": kind, "targetLink": f"http://x/compute/v1/projects/p/zones/z/instances/{name}",
          "status": "DONE", "insertTime": at(inserted), "endTime": at(ended)}
    if request_id:
        op["clientOperationId"] = request_id
    if error:
        op["error"] = {"errors": [{"code": "CONDITION_NOT_MET"}]}
    return op


def test_a_vm_lives_from_the_accepted_insert_to_its_delete_done():
    requests = [
        insert_post("vm-a", 10.0, "r1"),  # refused on its operation: a full reservation, no VM
        insert_post("vm-a", 70.25, "r2"),
        {"time": at(300), "method": "DELETE", "path": "/compute/v1/projects/p/zones/z/instances/vm-a",
         "query": {}, "body": None, "status": 200},
    ]
    operations = [
        operation("insert", "vm-a", 10.0, 11.0, "r1", error=True),
        operation("insert", "vm-a", 70.2, 90.0, "r2"),
        operation("delete", "vm-a", 300.0, 312.5),
    ]
    [(name, life)] = figures.vm_lifetimes(requests, operations).items()
    assert name == "vm-a"
    assert life["start"] == pytest.approx(epoch(70.25))  # the POST's log time, not the refused one's
    assert life["end"] == pytest.approx(epoch(312.5))
    assert life["seconds"] == pytest.approx(242.25)


def test_a_vm_not_deleted_has_no_end_and_one_never_made_has_no_life():
    operations = [operation("insert", "vm-b", 5.0, 6.0), operation("insert", "vm-c", 5.0, 6.0, error=True)]
    lives = figures.vm_lifetimes([], operations)
    assert set(lives) == {"vm-b"}
    assert lives["vm-b"]["start"] == pytest.approx(epoch(5.0))  # no logged POST: the operation's insertTime
    assert lives["vm-b"]["end"] is None and lives["vm-b"]["seconds"] is None


def test_the_training_is_timed_by_its_pid_and_exit_code_files():
    manifest = [
        {"path": "home/maxtext/maxtext-sft-runs/run-1/pid", "size": 5, "mtime": 100.0},
        {"path": "home/maxtext/maxtext-sft-runs/run-1/exit_code", "size": 2, "mtime": 160.5},
        {"path": "home/maxtext/maxtext-sft-runs/run-10/exit_code", "size": 2, "mtime": 999.0},
    ]
    assert figures.marker_times(manifest, "run-1") == (100.0, 160.5)
    assert figures.marker_times(manifest, "run-2") == (None, None)
    assert figures.marker_times(None, "run-1") == (None, None)


def test_time_goes_to_the_first_interval_that_covers_it_and_the_rest_elsewhere():
    totals = figures.attribute(
        (0.0, 100.0),
        [
            ("work", 20.0, 50.0),
            ("sensor", 40.0, 60.0),  # overlaps work: only 50-60 is the sensor's
            ("boot", -5.0, 10.0),  # sticks out of the span
            ("unknown end", 70.0, None),
        ],
        rest="gaps",
    )
    assert totals == {"boot": 10.0, "gaps": 50.0, "work": 30.0, "sensor": 10.0}
    assert sum(totals.values()) == 100.0


def event(name, task, seconds, run="run-1"):
    return {"event": name, "when": at(seconds), "run_id": run, "task_id": task, "map_index": -1, "try_number": 1}


def test_running_stretches_pair_each_start_with_the_state_it_left_running_as():
    rows = [
        event("running", "wait_for_final_checkpoint", 10), event("up_for_reschedule", "wait_for_final_checkpoint", 12),
        event("running", "wait_for_final_checkpoint", 22), event("success", "wait_for_final_checkpoint", 23.5),
        event("running", "create_vm", 1), event("deferred", "create_vm", 2),
        event("running", "export_to_hf", 30),  # still running: no end row yet
        {"event": "trigger dag run", "when": at(0), "run_id": "run-1", "task_id": None},
    ]
    stretches = figures.running_intervals(rows)
    seen = sorted((s["task_id"], s["end"] - s["start"], s["ended_as"]) for s in stretches)
    assert seen == [
        ("create_vm", pytest.approx(1.0), "deferred"),
        ("wait_for_final_checkpoint", pytest.approx(1.5), "success"),
        ("wait_for_final_checkpoint", pytest.approx(2.0), "up_for_reschedule"),
    ]
    # Inside a training window 11-23: one second of the first poke, 1 s of the last.
    assert figures.slots_during(stretches, (epoch(11), epoch(23))) == pytest.approx(2.0)


def test_a_capacity_wait_holds_slots_only_for_the_tries_that_deferred():
    stretches = [
        {"start": 0.0, "end": 1.5, "ended_as": "deferred"},
        {"start": 61.0, "end": 62.0, "ended_as": "deferred"},
        {"start": 121.0, "end": 140.0, "ended_as": "success"},  # inserted, waited for the boot
    ]
    held, blocking = figures.capacity_wait(stretches)
    assert held == pytest.approx(2.5)
    assert blocking == pytest.approx(121.0)
    assert figures.capacity_wait([{"start": 0.0, "end": 9.0, "ended_as": "success"}]) == (0.0, 0.0)


def test_a_wait_on_the_triggerer_before_the_first_try_holds_no_slot_but_counts_as_blocking():
    """create_vm started on the triggerer (CreateVmStartTrigger) waited from 10 s, when its upstream
    ended, to 70 s: no slot held, 60 s a blocking wait would have held."""
    started_on_the_triggerer = [{"start": 70.0, "end": 72.0, "ended_as": "success"}]
    assert figures.capacity_wait(started_on_the_triggerer, ready_at=10.0) == (0.0, pytest.approx(60.0))
    assert figures.capacity_wait([], ready_at=10.0) == (0.0, 0.0)


def test_backfill_waves_and_the_lag_from_a_freed_unit_to_the_next_insert():
    assert figures.waves(4, 2) == 2 and figures.waves(5, 2) == 3 and figures.waves(1, 4) == 1
    lives = {
        "a": {"start": 0.0, "end": 100.0}, "b": {"start": 1.0, "end": 110.0},
        "c": {"start": 130.0, "end": 230.0}, "d": {"start": 140.0, "end": None},
    }
    assert figures.unit_idle_gaps(lives, 2) == [30.0, 30.0]


def test_the_table_has_one_header_and_a_row_per_figure():
    table = figures.format_table([{"figure": "x", "measured": "1.5", "goal": "<= 1", "met?": "NO",
                                   "what the rest is spent on": "boot 3.0 s"}])
    lines = table.splitlines()
    assert len(lines) == 3 and lines[0].startswith("| figure") and "| NO " in lines[2]
    assert figures.spent_on({"boot": 3.0, "gaps": 10.25, "tiny": 0.01}) == "gaps 10.2 s, boot 3.0 s"


def test_every_vm_of_a_preempted_spot_run_lives_from_its_insert_to_its_preemption_or_delete():
    """A Spot VM preempted twice and made again under its name each time: three VMs. A preempted
    one ends at its compute.instances.preempted operation plus the soft off (the cloud deletes it
    with no delete operation); the last at its delete DONE. `vm_lifetimes` keeps only the last."""
    requests = [insert_post("spot", 0.0, "r1"), insert_post("spot", 40.5, "r2"), insert_post("spot", 80.25, "r3"),
                insert_post("other", 10.0, "r4")]
    preempted = {"operationType": "compute.instances.preempted", "status": "DONE",
                 "targetLink": "http://x/compute/v1/projects/p/zones/z/instances/spot"}
    operations = [
        operation("insert", "spot", 0.1, 5.0, "r1"),
        {**preempted, "insertTime": at(30.0), "endTime": at(30.0)},
        operation("insert", "spot", 40.6, 45.0, "r2"),
        {**preempted, "insertTime": at(70.0), "endTime": at(70.0)},
        operation("insert", "spot", 80.3, 85.0, "r3"),
        operation("delete", "spot", 150.0, 151.5),
        operation("insert", "other", 10.1, 11.0, "r4"),  # another VM, never deleted
    ]
    lives = figures.vm_lives(requests, operations, soft_off_seconds=1.0)
    spot = lives["spot"]
    assert [life["ended_by"] for life in spot] == ["preempted", "preempted", "delete"]
    assert [life["start"] for life in spot] == [pytest.approx(epoch(s)) for s in (0.0, 40.5, 80.25)]
    assert [life["end"] for life in spot] == [pytest.approx(epoch(e)) for e in (31.0, 71.0, 151.5)]
    assert [life["seconds"] for life in spot] == [pytest.approx(s) for s in (31.0, 30.5, 71.25)]
    assert spot[0]["preempted_at"] == pytest.approx(epoch(30.0)) and spot[2]["preempted_at"] is None
    assert sum(life["seconds"] for life in spot) == pytest.approx(132.75)
    assert lives["other"] == [{"start": pytest.approx(epoch(10.0)), "end": None, "seconds": None, "ended_by": None,
                               "preempted_at": None}]
    assert figures.vm_lifetimes(requests, operations)["spot"] == {
        "start": pytest.approx(epoch(80.25)), "end": pytest.approx(epoch(151.5)), "seconds": pytest.approx(71.25)}
