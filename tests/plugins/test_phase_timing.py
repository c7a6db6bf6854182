"""Phase times collected by the callbacks and summarised by summarize_run, on real task runs.

`dag.test()` runs tests/plugins/summary_dag/summary_probe.py through the Task SDK and the
execution API, as a worker would: with a retried task, a reschedule-mode sensor, a failed task and
tasks that never ran; and once failing before the VM.
"""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path

import pytest

from maxtext_sft.results.summary import PHASE_KEY
from tests.conftest import local_bucket

PROBE_DAGS = Path(__file__).parent / "summary_dag"
PRICE = 36.0  # summary_probe.HOURLY_PRICE


@pytest.fixture(scope="module")
def probe_dag(airflow_db):
    """The probe DAG, in a DAG bundle of its own (dag.test() runs only DAGs a bundle holds)."""
    from airflow.dag_processing.dagbag import DagBag

    bundles = [
        {"name": "dags-folder", "classpath": "airflow.dag_processing.bundles.local.LocalDagBundle", "kwargs": {}},
        {
            "name": "summary-probe",
            "classpath": "airflow.dag_processing.bundles.local.LocalDagBundle",
            "kwargs": {"path": str(PROBE_DAGS), "refresh_interval": 0},
        },
    ]
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("AIRFLOW__DAG_PROCESSOR__DAG_BUNDLE_CONFIG_LIST", json.dumps(bundles))
        bag = DagBag(str(PROBE_DAGS))
        assert bag.import_errors == {}
        yield bag.dags["summary_probe"]


def run_probe(dag, scratch: Path, **conf):
    """Run the DAG once; its run state, every XCom of the run by "task.key", and the tasks' notes."""
    from airflow.models.xcom import XComModel
    from airflow.utils.session import create_session
    from sqlalchemy import select

    dag_run = dag.test(run_conf={"scratch": str(scratch), **conf})
    with create_session() as session:
        rows = session.scalars(
            select(XComModel).where(XComModel.dag_id == dag_run.dag_id, XComModel.run_id == dag_run.run_id)
        ).all()
        xcoms = {f"{x.task_id}.{x.key}": XComModel.deserialize_value(x) for x in rows}
    notes_file = scratch / "notes.jsonl"
    notes = [json.loads(line) for line in notes_file.read_text().splitlines()] if notes_file.exists() else []
    return str(dag_run.state), xcoms, notes


def t(text: str) -> datetime:
    return datetime.fromisoformat(text)


BUCKET = "summary-probe"


@pytest.fixture(scope="module")
def bucket(local_cloud, pipeline_connections):
    """A bucket of the local cloud, which google_cloud_default (pipeline_connections) reaches."""
    return local_bucket(local_cloud, BUCKET)


@pytest.fixture(scope="module")
def finished(probe_dag, bucket, tmp_path_factory):
    return run_probe(probe_dag, tmp_path_factory.mktemp("summary-probe"), output_location=f"gs://{BUCKET}/probe")


def test_the_summary_runs_last_but_one_and_the_outcome_still_decides(finished):
    state, xcoms, _ = finished
    assert state == "failed"
    summary = xcoms["summarize_run.return_value"]
    assert summary["outcome"] == "failed"
    assert summary["not_succeeded"] == {
        "export_to_hf": "failed", "collect_outputs": "upstream_failed", "publish_to_hub": "upstream_failed"
    }
    assert "summarize_run" not in xcoms.get("check_run_outcome.failure", "")
    assert "export_to_hf: AirflowFailException: export failed" in xcoms["check_run_outcome.failure"]


def test_phases_are_in_pipeline_order_with_states_and_tries(finished):
    _, xcoms, _ = finished
    rows = {row["task_id"]: row for row in xcoms["summarize_run.return_value"]["phases"]}
    # Airflow's own topological sort of the DAG (TaskGroup.topological_sort), what waits for the
    # summary left out.
    assert list(rows) == [
        "plan_run", "vm_lease", "create_vm", "wait_for_final_checkpoint", "export_to_hf",
        "collect_outputs", "publish_to_hub", "delete_vm",
    ]
    assert {task_id: row["state"] for task_id, row in rows.items()} == {
        "plan_run": "success", "vm_lease": "success", "create_vm": "success", "wait_for_final_checkpoint": "success",
        "export_to_hf": "failed", "collect_outputs": "upstream_failed", "delete_vm": "success",
        "publish_to_hub": "upstream_failed",
    }
    assert rows["create_vm"]["tries"] == 2 and rows["wait_for_final_checkpoint"]["tries"] == 1
    # Never ran: the scheduler's no-op setup, and what the failure cut off.
    for task_id in ("vm_lease", "collect_outputs", "publish_to_hub"):
        assert rows[task_id]["started"] is None and rows[task_id]["duration_seconds"] is None, task_id
    assert rows["export_to_hf"]["started"] and rows["export_to_hf"]["duration_seconds"] >= 0  # a failed phase has times


def test_a_retried_phase_starts_at_its_first_try(finished):
    _, xcoms, notes = finished
    record = xcoms[f"create_vm.{PHASE_KEY}"]
    first, second = (t(n["at"]) for n in notes if n["task"] == "create_vm")
    assert t(record["started"]) <= first < second <= t(record["ended"])
    assert record["try_number"] == 2


def test_a_reschedule_sensor_phase_runs_from_its_first_poke_to_its_last(finished):
    _, xcoms, notes = finished
    record = xcoms[f"wait_for_final_checkpoint.{PHASE_KEY}"]
    pokes = [t(n["at"]) for n in notes if n["task"] == "wait_for_final_checkpoint"]
    assert len(pokes) == 3  # rescheduled twice: three runs of the task, each its own start_date
    # Not the last poke's start (what ti.start_date says at the end): the first one's.
    assert t(record["started"]) <= pokes[0] < pokes[1] < pokes[2] <= t(record["ended"])
    assert t(xcoms[f"create_vm.{PHASE_KEY}"]["ended"]) <= t(record["started"])
    row = next(r for r in xcoms["summarize_run.return_value"]["phases"] if r["task_id"] == "wait_for_final_checkpoint")
    assert row["duration_seconds"] >= (pokes[2] - pokes[0]).total_seconds()


def test_the_vm_lifetime_and_cost_come_from_create_and_delete(finished):
    _, xcoms, _ = finished
    summary = xcoms["summarize_run.return_value"]
    vm = summary["vm"]
    created, deleted = xcoms[f"create_vm.{PHASE_KEY}"], xcoms[f"delete_vm.{PHASE_KEY}"]
    assert vm["existed"] and vm["deleted"]
    assert (vm["started"], vm["ended"]) == (created["started"], deleted["ended"])
    seconds = (t(deleted["ended"]) - t(created["started"])).total_seconds()
    assert vm["lifetime_seconds"] == pytest.approx(seconds, abs=0.001)
    assert vm["hourly_price_usd"] == PRICE
    assert vm["estimated_cost_usd"] == round(seconds / 3600 * PRICE, 2)
    assert (summary["final_step"], summary["final_loss"]) == (3, "1.250")
    assert summary["outputs"] is None and summary["warnings"] == []


def test_with_an_output_location_the_summary_is_written_beside_the_run_record(finished, bucket):
    _, xcoms, _ = finished
    summary = xcoms["summarize_run.return_value"]
    run_name = xcoms["plan_run.spec"]["run_name"]
    assert summary["run_summary"] == f"gs://{BUCKET}/probe/runs/{run_name}/run-summary.json"
    assert json.loads(bucket.blob(f"probe/runs/{run_name}/run-summary.json").download_as_bytes()) == summary


def test_a_run_that_fails_before_the_vm_is_still_summarised_with_no_cost(probe_dag, tmp_path):
    state, xcoms, _ = run_probe(probe_dag, tmp_path, fail_early=True)
    assert state == "failed"
    summary = xcoms["summarize_run.return_value"]
    assert summary["not_succeeded"]["plan_run"] == "failed"
    assert summary["vm"]["existed"] is False and summary["vm"]["estimated_cost_usd"] == 0
    assert summary["phases"][0]["started"] and summary["phases"][0]["state"] == "failed"
