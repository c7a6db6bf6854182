"""The janitor: which VMs it condemns, the command (Airflow down) and the DAG (Task SDK)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from localcloud.connections import LOCAL_PROJECT, LOCAL_RUN_CONF
from maxtext_sft.hooks.compute import ComputeEngineEndpointHook
from maxtext_sft.instances import EXPIRY_LABEL
from maxtext_sft.janitor import UNKNOWN, condemned
from maxtext_sft.run_names import PACKAGE_LABEL
from tests.conftest import REPO
from tests.plugins.test_spec import make_spec

ZONE = "us-east5-b"
NOW = 1_800_000_000


def instance(name: str, *, labels: dict | None = None, run_id: str | None = "manual__1") -> dict:
    metadata = [{"key": "airflow-dag-id", "value": "maxtext_sft"}] if run_id else []
    if run_id:
        metadata.append({"key": "airflow-run-id", "value": run_id})
    return {"name": name, "zone": f"projects/p/zones/{ZONE}", "labels": labels or {}, "metadata": {"items": metadata}}


OURS = {"managed-by": PACKAGE_LABEL}


@pytest.mark.parametrize(
    ("vm", "state", "reason"),
    [
        (instance("not-ours", labels={"managed-by": "someone-else", EXPIRY_LABEL: "1"}), None, None),
        (instance("unlabelled", labels={}), None, None),
        (instance("expired", labels={**OURS, EXPIRY_LABEL: str(NOW - 1)}), "running", "its lifetime ended"),
        (instance("live", labels={**OURS, EXPIRY_LABEL: str(NOW + 60)}), "running", None),
        (instance("queued", labels=OURS), "queued", None),
        (instance("run-failed", labels=OURS), "failed", "is failed"),
        (instance("run-succeeded", labels=OURS), "success", "is success"),
        (instance("run-deleted", labels=OURS), None, "no longer exists"),
        (instance("airflow-down", labels=OURS), UNKNOWN, None),
        (instance("no-run-metadata", labels=OURS, run_id=None), None, None),
    ],
    ids=lambda value: value["name"] if isinstance(value, dict) else None,
)
def test_what_the_janitor_condemns(vm, state, reason):
    from airflow.utils.state import DagRunState

    # The Task SDK hands back DagRunState members: "running" must read as running, not as
    # "DagRunState.RUNNING" (which once condemned a live run's VM).
    if state in ("running", "queued", "failed", "success"):
        enum_doomed = condemned([vm], lambda dag_id, run_id: DagRunState(state), NOW)
        assert enum_doomed == condemned([vm], lambda dag_id, run_id: state, NOW)
    doomed = condemned([vm], lambda dag_id, run_id: state, NOW)
    if reason is None:
        assert doomed == []
    else:
        assert len(doomed) == 1 and reason in doomed[0].reason and doomed[0].zone == ZONE


@pytest.fixture
def leftover_vms(local_cloud, pipeline_connections):
    """Instances created straight through the API: one expired, one live, one not ours."""
    hook = ComputeEngineEndpointHook(gcp_conn_id="google_cloud_default")
    made = {}
    for name, labels, run_id in [
        ("expired", {EXPIRY_LABEL: str(int(time.time()) - 5)}, "manual__gone-long-ago"),
        ("live", {EXPIRY_LABEL: str(int(time.time()) + 3600)}, "manual__still-running"),
        ("foreign", None, "manual__x"),
    ]:
        spec = make_spec(
            run_id=f"{name}-{time.time_ns()}", project_id=LOCAL_PROJECT, reservation=LOCAL_RUN_CONF["reservation"]
        )
        body = spec.instance_body()
        body["labels"] = {**body["labels"], **labels} if labels is not None else {"team": "other"}
        body["metadata"]["items"][-1]["value"] = run_id
        hook.insert_instance(body=body, zone=spec.zone, project_id=LOCAL_PROJECT)
        made[name] = spec.vm_name
    yield made
    for vm in local_cloud.vms():
        if vm["name"] in made.values():
            hook.delete_instance(resource_id=vm["name"], zone=ZONE, project_id=LOCAL_PROJECT)


def test_the_command_deletes_expired_vms_without_airflow(leftover_vms, local_cloud, pipeline_connections):
    env = {**os.environ, "PYTHONPATH": str(REPO / "plugins")}
    result = subprocess.run(
        [sys.executable, "-m", "maxtext_sft.janitor", "--project", LOCAL_PROJECT],
        capture_output=True, text=True, env=env, timeout=120,
    )
    assert result.returncode == 0, result.stderr
    deleted = json.loads(result.stdout.strip().splitlines()[-1])
    assert [vm["name"] for vm in deleted] == [leftover_vms["expired"]]
    assert "its lifetime ended" in deleted[0]["reason"] and "its lifetime ended" in result.stderr
    left = {vm["name"] for vm in local_cloud.vms()}
    assert leftover_vms["expired"] not in left
    assert {leftover_vms["live"], leftover_vms["foreign"]} <= left  # live, and not ours: untouched


def test_the_dag_deletes_vms_whose_run_is_gone(leftover_vms, local_cloud, airflow_db):
    from airflow.dag_processing.dagbag import DagBag

    dag = DagBag(str(REPO / "dags")).dags["maxtext_sft_janitor"]
    run = dag.test(run_conf={"project_id": LOCAL_PROJECT})
    assert str(run.state) == "success"
    left = {vm["name"] for vm in local_cloud.vms()}
    # "live" is not expired, but its DAG run does not exist in this Airflow: the DAG deletes it.
    assert leftover_vms["expired"] not in left and leftover_vms["live"] not in left
    assert leftover_vms["foreign"] in left


def test_the_dag_tells_a_declared_jobs_owners_which_vm_it_deleted(local_cloud, airflow_db, tmp_path, monkeypatch):
    from airflow.dag_processing.dagbag import DagBag

    from localcloud.webhook import WebhookReceiver

    hook = ComputeEngineEndpointHook(gcp_conn_id="google_cloud_default")
    spec = make_spec(run_id=f"gone-{time.time_ns()}", project_id=LOCAL_PROJECT, reservation=LOCAL_RUN_CONF["reservation"])
    body = spec.instance_body()
    body["labels"][EXPIRY_LABEL] = str(int(time.time()) - 5)
    body["metadata"]["items"][-2]["value"] = "team_job"  # airflow-dag-id: a declared job's DAG
    (tmp_path / "team-job.yaml").write_text(
        "dag_id: team_job\nschedule: '@daily'\nstart_date: 2026-11-01\nnotify: {conn_id: team_webhook}\n"
        "params: {reservation: team-reservation}\n"
    )
    monkeypatch.setenv("MAXTEXT_SFT_JOBS_DIR", str(tmp_path))
    with WebhookReceiver() as webhook:
        monkeypatch.setenv("AIRFLOW_CONN_TEAM_WEBHOOK", webhook.connection_uri())
        hook.insert_instance(body=body, zone=spec.zone, project_id=LOCAL_PROJECT)
        dag = DagBag(str(REPO / "dags")).dags["maxtext_sft_janitor"]
        run = dag.test(run_conf={"project_id": LOCAL_PROJECT})
        assert str(run.state) == "success"
        assert spec.vm_name not in {vm["name"] for vm in local_cloud.vms()}
        [message] = webhook.wait_for(lambda m: m.get("vm_name") == spec.vm_name, timeout=5)
    assert message["event"] == "vm_deleted_by_janitor"
    assert message["dag_id"] == "team_job" and message["run_id"] == spec.run_id
    assert "its lifetime ended" in message["message"]
