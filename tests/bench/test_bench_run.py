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
            "--seconds-per-step", "0.05", "--skip-parse-cost", "--run-timeout", "300"]


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
    assert figures[0] == "VM billed time / workload time (cold run)" and len(figures) == 6
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
