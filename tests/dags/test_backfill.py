"""A declared job backfilled over three days through Airflow's real scheduler (PostgreSQL).

Each run pins its own dataset snapshot, trains on its own VM under its own run_name and writes
its own outputs; the reservation holds two VMs, so the capacity gate makes the third run wait
(deferred, holding no worker slot) instead of failing. A failed run tells the job's webhook."""

from __future__ import annotations

import json
from datetime import datetime, timedelta, timezone

import pytest
import yaml

from bench.run import compute_operations
from localcloud.connections import LOCAL_HUB_USER, LOCAL_OUTPUTS_CONF, LOCAL_PROJECT, LOCAL_RUN_CONF
from localcloud.webhook import WebhookReceiver
from maxtext_sft.cloud.storage import StorageEndpointHook
from tests.dags.conftest import wait_for_run_end, wait_until

pytestmark = pytest.mark.e2e

DAG_ID = "team_nightly"
DATASET = f"{LOCAL_HUB_USER}/daily-chats"  # the test token's own namespace
RESERVATION = "backfill-reservation"
CAPACITY = 2
# Three runs on a reservation of two: one more than it holds is enough to make a run wait (a
# fourth run added ~a quarter to the test's CPU, every task a process, and proved nothing more).
DAYS = [datetime(2026, 11, day, tzinfo=timezone.utc) for day in (1, 2, 3)]
LOADER = 'from airflow.sdk import DAG\nfrom maxtext_sft.builders.jobs import declared_job_dag\ndag: DAG = declared_job_dag("team-nightly.yaml")\n'


@pytest.fixture
def dataset_history(local_cloud, pipeline_connections):
    """A commit at noon the day before each run's date: run N pins commit N."""
    seeded = local_cloud.hub.seed_repo(
        DATASET,
        repo_type="dataset",
        commits=[
            {"files": {"data/train_sft-00000-of-00001.parquet": f"chats of {day - timedelta(hours=12):%b %d}",
                       "data/test_sft-00000-of-00001.parquet": f"held-out chats of {day - timedelta(hours=12):%b %d}"},
             "date": (day - timedelta(hours=12)).isoformat()}
            for day in DAYS
        ],
    )
    return seeded["commits"]


@pytest.fixture
def team_job(tmp_path, local_cloud):
    """The job's YAML and its loader, in folders of their own (the repo's jobs stay out of it)."""
    local_cloud.add_reservation(RESERVATION, CAPACITY, zone="us-east5-b", project=LOCAL_PROJECT)
    jobs, dags = tmp_path / "jobs", tmp_path / "dags"
    jobs.mkdir(), dags.mkdir()
    (jobs / "team-nightly.yaml").write_text(yaml.safe_dump({
        "dag_id": DAG_ID,
        "schedule": "@daily",
        "start_date": "2026-11-01",
        "end_date": "2026-11-03",  # no scheduled run once unpaused: only the backfill's
        "notify": {"conn_id": "team_webhook"},
        "params": {
            **LOCAL_RUN_CONF,
            "reservation": RESERVATION,
            "dataset_name": DATASET,
            "output_location": f"{LOCAL_OUTPUTS_CONF['output_location']}/backfill",  # its own conversion cache
            "steps": 20,
            "max_capacity_wait_minutes": 30,
        },
    }))
    (dags / "job_team_nightly.py").write_text(LOADER)
    return jobs, dags


def why_failed(airflow, runs) -> str:
    """Each failed run's task states and its first failed task's log tail (the assertion's message)."""
    report = []
    for run in runs:
        if run["state"] == "success":
            continue
        states = airflow.task_states(run["dag_run_id"])
        report.append(f"{run['dag_run_id']}: {states}")
        failed = [task for task, state in states.items() if state == "failed" and task != "check_run_outcome"]
        for entry in airflow.task_log(run["dag_run_id"], failed[0]) if failed else []:
            for error in entry.get("error_detail", []) if isinstance(entry, dict) else []:
                report.append(f"{failed[0]}: {error.get('exc_type')}: {error.get('exc_value')}")
    return "\n".join(report)


def vm_lifetimes(requests: list[dict], operations: list[dict]) -> dict[str, tuple[str, str | None]]:
    """VM name -> (accepted insert time, accepted delete time) from the compute emulator's request
    log. Only the insert whose operation made the VM counts (found by its requestId, the
    operation's clientOperationId): an insert refused on its operation, as when two waiting runs
    saw the same free machine and the other got it, made no VM."""
    made = {
        op.get("clientOperationId")
        for op in operations
        if op.get("operationType") == "insert" and op.get("status") == "DONE" and "error" not in op
    }
    lives: dict[str, list] = {}
    for entry in requests:
        if entry["status"] != 200:
            continue
        if entry["method"] == "POST" and entry["path"].endswith("/instances"):
            if (entry.get("query") or {}).get("requestId") in made:
                lives.setdefault(entry["body"]["name"], [entry["time"], None])
        elif entry["method"] == "DELETE" and "/instances/" in entry["path"]:
            name = entry["path"].rsplit("/", 1)[-1]
            if name in lives and lives[name][1] is None:
                lives[name][1] = entry["time"]
    return {name: tuple(life) for name, life in lives.items()}


def most_alive_at_once(lives) -> int:
    events = sorted([(start, 1) for start, _ in lives.values()] + [(end, -1) for _, end in lives.values() if end])
    alive = most = 0
    for _, change in events:  # at equal times the delete (-1) sorts first: it freed the unit
        alive += change
        most = max(most, alive)
    return most


def test_a_backfill_over_three_days_trains_each_on_its_snapshot_two_vms_at_a_time(
    start_airflow, team_job, dataset_history, local_cloud, pipeline_connections
):
    jobs, dags = team_job
    with WebhookReceiver() as webhook:
        airflow = start_airflow(
            {"MAXTEXT_SFT_JOBS_DIR": str(jobs), "AIRFLOW_CONN_TEAM_WEBHOOK": webhook.connection_uri()},
            dags_folder=dags, dag_id=DAG_ID, parallelism=6,
        )
        dag = airflow.get(f"/api/v2/dags/{DAG_ID}")
        assert dag["is_paused"] is True  # a declared job spends nothing until someone unpauses it
        assert dag["max_active_runs"] == 1
        airflow.request("PATCH", f"/api/v2/dags/{DAG_ID}?update_mask=is_paused", {"is_paused": False})

        # A failed run (preflight: no such reservation) is told to the job's webhook.
        failing = airflow.request("POST", f"/api/v2/dags/{DAG_ID}/dagRuns",
                                  {"logical_date": None, "conf": {"reservation": "no-such-reservation"}})["dag_run_id"]
        assert wait_for_run_end(airflow, failing, dag_id=DAG_ID)["state"] == "failed"
        [told] = webhook.wait_for(lambda m: m.get("run_id") == failing, timeout=120)
        assert told["dag_id"] == DAG_ID and told["event"] == "run_failed"

        local_cloud.clear_requests()
        airflow.cli("backfill", "create", "--dag-id", DAG_ID, "--from-date", "2026-11-01", "--to-date", "2026-11-03",
                    "--max-active-runs", "4")

        def backfill_runs():
            runs = airflow.get(f"/api/v2/dags/{DAG_ID}/dagRuns?run_type=backfill&order_by=logical_date")["dag_runs"]
            return runs if len(runs) == len(DAYS) and all(r["state"] in ("success", "failed") for r in runs) else None

        runs = wait_until(backfill_runs, 1500, "the three backfill runs to end")
    assert [r["state"] for r in runs] == ["success"] * len(DAYS), why_failed(airflow, runs)
    assert [datetime.fromisoformat(r["logical_date"]) for r in runs] == DAYS

    specs = [airflow.xcom(r["dag_run_id"], "plan_run", "spec") for r in runs]
    # Each run pinned the commit current at its date, and trained on that commit's files.
    assert [spec["dataset_revision"] for spec in specs] == dataset_history
    assert all(spec["dataset_files"] == ["data/train_sft-00000-of-00001.parquet"] for spec in specs)
    assert len({spec["run_name"] for spec in specs}) == len({spec["vm_name"] for spec in specs}) == len(DAYS)

    # A run record per run, in its own run folder, each naming its own snapshot.
    storage = StorageEndpointHook(gcp_conn_id="google_cloud_default")
    for spec, revision in zip(specs, dataset_history):
        bucket, _, name = spec["output_location"].removeprefix("gs://").partition("/")
        record = json.loads(storage.download(bucket, f"{name}/runs/{spec['run_name']}/run-record.json"))
        assert record["dataset_revision"] == revision and record["run_name"] == spec["run_name"]
        assert record["dataset_files"] == ["data/train_sft-00000-of-00001.parquet"]

    # Never more VMs than the reservation holds; every VM deleted.
    lives = vm_lifetimes(local_cloud.requests(), compute_operations(local_cloud))
    assert set(lives) == {spec["vm_name"] for spec in specs}
    assert all(end is not None for _, end in lives.values()), lives
    assert most_alive_at_once(lives) == CAPACITY
    assert not [vm for vm in local_cloud.vms() if vm["name"] in lives]

    # Lineage: one tuned-model Asset event per run, with what made the model.
    events = airflow.get(f"/api/v2/assets/events?source_dag_id={DAG_ID}&order_by=timestamp")["asset_events"]
    extras = sorted((e["extra"] for e in events), key=lambda extra: extra["dataset_revision"])
    assert sorted(e["source_run_id"] for e in events) == sorted(r["dag_run_id"] for r in runs)
    assert sorted(dataset_history) == [extra["dataset_revision"] for extra in extras]
    for extra in extras:
        assert extra["location"].startswith("gs://") and extra["location"].endswith("/hf-export")
        assert extra["steps"] == 20 and float(extra["final_loss"]) > 0 and extra["base_model"] == "google/gemma-3-4b-it"
