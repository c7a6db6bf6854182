"""The janitor: which VMs it condemns, the command (Airflow down) and the DAG (Task SDK)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from localcloud.connections import LOCAL_PROJECT, LOCAL_RUN_CONF
from maxtext_sft.cloud.compute import ComputeEngineEndpointHook
from maxtext_sft.cloud.instances import EXPIRY_LABEL
from maxtext_sft.tasks.janitor import UNKNOWN, condemned
from maxtext_sft.run.names import PACKAGE_LABEL
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
        [sys.executable, "-m", "maxtext_sft.tasks.janitor", "--project", LOCAL_PROJECT],
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


def test_the_command_deletes_an_expired_slices_group_template_and_policy(local_cloud, pipeline_connections):
    """A slice's host is not deleted alone (its group would make it again): the janitor deletes
    the group, its hosts with it, then the template and the workload policy."""
    from google.api_core.exceptions import NotFound

    from localcloud.connections import LOCAL_ZONE
    from tests.dags.conftest import wait_until
    from tests.plugins.test_slice_spec import make_slice_spec

    local_cloud.add_reservation("janitor-slice-reservation", 4, "ct6e-standard-4t", zone=LOCAL_ZONE, project=LOCAL_PROJECT)
    spec = make_slice_spec(project_id=LOCAL_PROJECT, reservation="janitor-slice-reservation", vm_name_prefix="janitor")
    hook = ComputeEngineEndpointHook(gcp_conn_id="google_cloud_default")
    template = spec.instance_template_body()
    template["properties"]["labels"][EXPIRY_LABEL] = str(int(time.time()) - 5)  # the slice outlived its lifetime
    hook.insert_resource_policy(body=spec.workload_policy_body(), region=spec.region, project_id=LOCAL_PROJECT)
    hook.insert_instance_template(body=template, project_id=LOCAL_PROJECT)
    hook.insert_instance_group_manager(body=spec.group_body(), zone=spec.zone, project_id=LOCAL_PROJECT)
    hosts = lambda: [vm["name"] for vm in local_cloud.vms() if vm["name"].startswith(spec.group_name + "-")]  # noqa: E731
    wait_until(lambda: len(hosts()) == 4, 120, "the group's 4 hosts")

    env = {**os.environ, "PYTHONPATH": str(REPO / "plugins")}
    result = subprocess.run(
        [sys.executable, "-m", "maxtext_sft.tasks.janitor", "--project", LOCAL_PROJECT],
        capture_output=True, text=True, env=env, timeout=180,
    )
    assert result.returncode == 0, result.stderr
    deleted = json.loads(result.stdout.strip().splitlines()[-1])
    assert {vm["group"] for vm in deleted if vm["name"].startswith(spec.group_name)} == {spec.group_name}
    assert f"deleting the slice {spec.group_name}" in result.stderr
    assert hosts() == []
    with pytest.raises(NotFound):
        hook.get_instance_group_manager(resource_id=spec.group_name, zone=spec.zone, project_id=LOCAL_PROJECT)
    with pytest.raises(NotFound):
        hook.get_instance_template(resource_id=spec.template_name, project_id=LOCAL_PROJECT)
    assert hook.get_resource_policy(name=spec.policy_name, region=spec.region, project_id=LOCAL_PROJECT) is None


def test_the_command_refuses_a_login_file_without_airflows_url(capsys):
    from maxtext_sft.tasks.janitor import main

    with pytest.raises(SystemExit) as refused:
        main(["--project", LOCAL_PROJECT, "--airflow-login", "janitor-login.json"])
    assert refused.value.code == 2
    assert "--airflow-login needs --airflow-url" in capsys.readouterr().err


def test_an_interval_of_zero_leaves_the_dag_unscheduled(tmp_path):
    """[maxtext_sft] janitor_interval_minutes = 0: the DAG runs only when triggered."""
    probe = ("from airflow.dag_processing.dagbag import DagBag; import sys; "
             "dag = DagBag(sys.argv[1]).dags['maxtext_sft_janitor']; print(type(dag.timetable).__name__, dag.schedule)")
    found = {}
    for minutes in ("0", "10"):
        env = {**os.environ, "PYTHONPATH": str(REPO / "plugins"), "AIRFLOW__MAXTEXT_SFT__JANITOR_INTERVAL_MINUTES": minutes}
        done = subprocess.run([sys.executable, "-c", probe, str(REPO / "dags" / "maxtext_sft_janitor.py")], env=env,
                              capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr[-2000:]
        found[minutes] = done.stdout.strip().splitlines()[-1]
    assert found == {"0": "NullTimetable None", "10": "DeltaTriggerTimetable 0:10:00"}, found
