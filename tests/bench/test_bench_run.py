"""`make bench` cannot rot unseen: its smallest configuration runs here end to end (one cold run
through Airflow's real scheduler on the local cloud), and a failed run stops the bench with the
run's cause and a non-zero exit instead of a traceback."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from bench import run as bench
from tests.conftest import REPO

SMALLEST = ["--snapshots", "0", "--cold-image", "", "--repeat-image", bench.NO_REPEAT, "--steps", "5",
            "--seconds-per-step", "0.05", "--spot-preemptions", "0", "--skip-parse-cost", "--run-timeout", "300"]


@pytest.mark.e2e
def test_the_smallest_bench_runs_the_pipeline_and_prints_its_figures(tmp_path):
    results = tmp_path / "bench-results.json"
    done = subprocess.run([sys.executable, "-m", "bench", *SMALLEST, "--json", str(results)],
                          cwd=REPO, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    measured = json.loads(results.read_text())
    [cold] = measured["runs"]
    assert cold["state"] == "success" and measured["vms_left"] == []
    # The run used the dataset's held-out split (Param eval_split's default), which the bench's
    # dataset once lacked: preflight refused the cold run.
    assert cold["conversion_did_work"] and cold["training"][0] is not None
    # The training wait started on the triggerer (start_from_trigger): no worker slot while the
    # training ran; the sensor's one stretch on a worker is its end, after the training's.
    slots = measured["worker_slots"]
    assert slots["training_held"] == 0 and slots["sensor_stretches"] == {"success": 1}, slots
    figures = [row["figure"] for row in measured["table"]]
    assert figures[0] == "VM billed time / workload time (cold run)" and len(figures) == 7
    assert "VM billed time / workload time (cold run)" in done.stdout


class FailedRunAirflow:
    """What trigger_and_wait reads from Airflow's REST API for a run that failed."""

    def trigger(self, conf):
        return "manual__1"

    def run(self, run_id, dag_id=None):
        return {"dag_run_id": run_id, "state": "failed",
                "note": "Failed at preflight: dataset x has no files data/test_sft-*.parquet"}

    def task_states(self, run_id, dag_id=None):
        return {"preflight": "failed"}


def test_a_failed_run_stops_the_bench_with_its_note():
    with pytest.raises(bench.RunFailed, match=r"cold run \(manual__1\) failed: Failed at preflight: dataset x"):
        bench.trigger_and_wait(FailedRunAirflow(), {}, timeout=10, what="cold run")


def test_a_failed_run_makes_the_bench_exit_non_zero_saying_why(monkeypatch, capsys, tmp_path):
    def measure(args):
        raise bench.RunFailed("the cold run (manual__1) failed: Failed at preflight")

    monkeypatch.setattr(bench, "measure", measure)
    assert bench.main([*SMALLEST, "--json", str(tmp_path / "r.json")]) == 1
    assert "The bench stopped: the cold run (manual__1) failed: Failed at preflight" in capsys.readouterr().out
    assert not (tmp_path / "r.json").exists()


def test_the_training_wait_row_says_how_each_stretch_on_a_worker_ended():
    # A deferrable wait's stretches are its checks before a deferral and its resumption, not
    # reschedule-mode pokes: the row once called every stretch a poke.
    text = bench.sensor_stretches_text({"deferred": 2, "success": 1})
    assert text.startswith("3 stretches of wait_for_final_checkpoint on a worker (2 ending deferred, 1 ending success)")
    assert bench.sensor_stretches_text({}) == "-"


def test_the_training_row_counts_what_waits_not_the_launch():
    """Slot-seconds inside a run's training (pid file to exit_code): the sensor's stretches count;
    start_training's end, a few milliseconds after the pid file it wrote, is the launch."""
    run = {"run_id": "r", "training": (100.0, 200.0)}
    stretches = [
        {"run_id": "r", "task_id": "start_training", "start": 95.0, "end": 100.02, "ended_as": "success"},
        {"run_id": "r", "task_id": "wait_for_final_checkpoint", "start": 150.0, "end": 151.0, "ended_as": "deferred"},
        {"run_id": "r", "task_id": "wait_for_final_checkpoint", "start": 200.5, "end": 201.5, "ended_as": "success"},
    ]
    slots = bench.worker_slots([run], stretches)
    assert slots["training_held"] == 1.0 and slots["training_blocking"] == 100.0
    assert slots["training_held_by_task"] == {"start_training": pytest.approx(0.02), "wait_for_final_checkpoint": 1.0}
    text = bench.training_slots_text(slots)
    assert text.startswith("inside the trainings: start_training 0.02 s; wait_for_final_checkpoint 1.00 s; ")
    assert "start_training's end after its training's pid file is the launch" in text


def test_a_twice_preempted_spot_run_is_billed_for_its_three_vms_and_the_rest_says_what_was_redone():
    """Three VMs of one name (two preempted: the preempted operation plus 1 s of soft off), each
    from its insert; the workload is the cold run's kind (install, conversion, export, the training
    processes) without the steps trained again after the checkpoint each new VM resumed from."""
    life = lambda start, end, preempted_at=None: {  # noqa: E731
        "start": start, "end": end, "seconds": end - start, "preempted_at": preempted_at,
        "ended_by": "preempted" if preempted_at else "delete"}
    lives = [life(0.0, 31.0, 30.0), life(40.5, 71.0, 70.0), life(80.25, 151.5)]
    run = {
        "phases": {"create_vm": (-1.0, 5.0), "wait_for_ssh": (5.0, 7.0), "install_maxtext": (7.0, 10.0),
                   "convert_checkpoint": (10.0, 14.0), "start_training": (14.0, 15.0),
                   "wait_for_final_checkpoint": (15.0, 120.0), "export_to_hf": (122.0, 130.0),
                   "collect_outputs": (131.0, 135.0), "delete_vm": (136.0, 151.6)},
        "training": (90.25, 112.0),  # the last VM's pid and exit_code files
        "preempted_vms": [{"step_logged_at_preemption": 10, "training": (15.0, None), "manifest_written": 31.02},
                          {"step_logged_at_preemption": 20, "training": (50.5, None), "manifest_written": 71.05}],
        "recoveries": [
            {"recovery": 1, "preempted": True, "resumes_after_step": 9, "steps_lost": 0, "vm_minutes_to_resume": 0.17,
             "step_seconds": {"wait_for_ssh": 6.0, "install": 1.0}},
            {"recovery": 2, "preempted": True, "resumes_after_step": 18, "steps_lost": 2, "vm_minutes_to_resume": 0.18,
             "step_seconds": {"wait_for_ssh": 7.0, "install": 1.5}},
        ],
    }
    spot = bench.spot_billed_over_workload(run, lives, seconds_per_step=1.0)
    assert spot["lifetime_seconds"] == pytest.approx(31.0 + 30.5 + 71.25)
    # install 3 + conversion 4 + export 8 + the trainings 14 + 17.5 + 21.75 (less 1 and 2 steps trained twice)
    assert spot["workload"][bench.TRAINING] == pytest.approx(53.25)
    assert spot["workload_seconds"] == pytest.approx(68.25)
    assert spot["measured"] == pytest.approx(132.75 / 68.25)
    assert spot["steps_lost"] == [1, 2] and spot["summary_steps_lost"] == [0, 2]
    rest = spot["rest"]
    assert rest[bench.TRAINED_TWICE] == pytest.approx(3.0) and rest[bench.SOFT_OFF] == pytest.approx(2.0)
    assert rest[bench.RESUME] == pytest.approx(20.0) and rest["sensor noticing the end"] == pytest.approx(8.0)
    assert rest["delete (delete_vm start -> operation DONE)"] == pytest.approx(15.5)
    assert sum(rest.values()) + spot["workload_seconds"] == pytest.approx(spot["lifetime_seconds"])
    assert spot["end_after_manifest"] == [pytest.approx(0.02), pytest.approx(0.05)]
    detail = bench.spot_detail(spot)
    assert "steps trained twice: 1+2 (" in detail and "the summary's steps_lost: 0+2)" in detail
    assert "resume steps, all recoveries: wait_for_ssh 13.0 s, install 2.5 s" in detail
    # A VM the bench did not preempt (or one it did that the cloud has no end for): no figure.
    assert bench.spot_billed_over_workload(run, lives[1:], 1.0)["measured"] is None
    assert bench.spot_billed_over_workload({**run, "preempter_error": "TimeoutError: x", "preempted_vms": []},
                                           lives, 1.0)["why"].endswith("(TimeoutError: x)")
    assert bench.preempt_steps(30, 2) == [10, 20] and bench.preempt_steps(60, 2) == [20, 40]
