"""The fine-tune on a multi-host TPU slice (v6e-16: 4 hosts of ct6e-standard-4t) under Airflow's
real scheduler, in the local cloud: a workload policy, an instance template and a managed
instance group whose hosts are sandboxed sshd VMs, the stand-in training on every host.

Each run must end with no group, template, policy or instance left; the bodies the run sends are
gcloud's documented commands' (tests/fixtures/gcloud-slice-requests.json) but for the fields the
pipeline adds, each explained."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.dags import fault_tally
from tests.dags.conftest import SHARED_AIRFLOW_GROUP, wait_for_run_end, wait_until

pytestmark = [pytest.mark.e2e, SHARED_AIRFLOW_GROUP]

DAG_ID = "maxtext_sft_slice"
RESERVATION = "local-slice-reservation"
HOSTS = 4
GCLOUD_SLICE = Path(__file__).resolve().parents[1] / "fixtures" / "gcloud-slice-requests.json"

# Fields in which the run's bodies differ from gcloud's, and why (run/slice_body.py, run/compute_body.py).
EXPLAINED_DIFFERENCES = {
    "policy": {"name": "named after the run's group"},
    "template": {
        "name": "named after the run's group",
        "properties.labels": "identify the package, DAG and run; the expiry label",
        "properties.tags": "a stable network tag Param",
        "properties.metadata": "the pipeline's SSH key, guest attributes on (host keys), the run's identity",
        "properties.serviceAccounts": "gcloud attaches the default service account's scopes; the pipeline's cloud-platform",
    },
    "group": {
        "name": "per run",
        "instanceTemplate": "the run's template",
        "resourcePolicies": "the run's workload policy",
        "baseInstanceName": "the provider's operator requires it; gcloud leaves the API to take the group's name",
        "instanceLifecyclePolicy": "a failed or stopped host stays down instead of being re-created and paid for",
    },
}


def _conf(local_bucket: str, **more) -> dict:
    from localcloud.connections import LOCAL_RUN_CONF

    return {
        **LOCAL_RUN_CONF,
        "reservation": RESERVATION,
        "tpu_slice": "v6e-16",
        "output_location": f"gs://{local_bucket}/maxtext-sft-slice",
        "steps": 12,
        **more,
    }


@pytest.fixture(scope="module")
def slice_reservation(local_cloud, shared_airflow):
    """The slice's reservation (4 ct6e-standard-4t), and the slice DAG parsed (the harness waits
    for the pipeline's DAG only)."""
    from localcloud.connections import LOCAL_PROJECT, LOCAL_ZONE

    local_cloud.add_reservation(RESERVATION, HOSTS, "ct6e-standard-4t", zone=LOCAL_ZONE, project=LOCAL_PROJECT)
    wait_until(lambda: shared_airflow.get(f"/api/v2/dags/{DAG_ID}", missing_ok=True), 120, "the slice DAG to be parsed")
    return RESERVATION


def _flatten(body: dict, prefix: str = "") -> dict:
    """A body as {dotted path: value}, resource URLs made relative (the endpoints differ)."""
    flat = {}
    for key, value in body.items():
        path = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            flat |= _flatten(value, path + ".")
        else:
            flat[path] = value
    return flat


def _differences(ours: dict, gclouds: dict, explained: dict) -> dict:
    def visible(flat: dict) -> dict:
        return {
            path: value for path, value in flat.items()
            if not any(path == field or path.startswith(field + ".") for field in explained)
        }

    a, b = visible(_flatten(ours)), visible(_flatten(gclouds))
    return {path: (a.get(path), b.get(path)) for path in a.keys() | b.keys() if a.get(path) != b.get(path)}


def _posts(requests: list[dict], collection: str) -> list[dict]:
    return [r["body"] for r in requests if r["method"] == "POST" and r["path"].split("?")[0].endswith("/" + collection)]


def _relative(body: dict, endpoint: str) -> dict:
    """URLs as gcloud sends them (full) or as the client library does (partial), made alike."""
    text = json.dumps(body).replace(endpoint, "").replace("http://127.0.0.1:8999/compute/v1/", "")
    return json.loads(text)


def _leftovers(names: dict) -> list[str]:
    """What of the run's slice still exists, read through the Compute API."""
    from google.api_core.exceptions import NotFound

    from maxtext_sft.cloud.compute import ComputeEngineEndpointHook

    hook = ComputeEngineEndpointHook(gcp_conn_id="google_cloud_default")
    where = {"project_id": names["project_id"]}
    left = []
    if hook.get_resource_policy(name=names["policy_name"], region=names["region"], **where) is not None:
        left.append(f"policy {names['policy_name']}")
    for kind, read in (
        ("template", lambda: hook.get_instance_template(resource_id=names["template_name"], **where)),
        ("group", lambda: hook.get_instance_group_manager(resource_id=names["group_name"], zone=names["zone"], **where)),
    ):
        try:
            read()
            left.append(kind)
        except NotFound:
            pass
    return left


def _log(airflow, run_id: str, task_id: str, try_number: int = 1) -> str:
    """A task try's log as text: the REST API's structured entries (with an error's details)."""
    return json.dumps(airflow.task_log(run_id, task_id, try_number, dag_id=DAG_ID))


def _run_error(airflow, run_id: str) -> str:
    return _log(airflow, run_id, "check_run_outcome")


# plan_run's XComs that name a run's slice resources (what _leftovers reads).
NAME_KEYS = ("project_id", "zone", "region", "policy_name", "template_name", "group_name")


def _names(airflow, run_id: str) -> dict:
    return {key: airflow.xcom(run_id, "plan_run", key=key, dag_id=DAG_ID) for key in NAME_KEYS}


def _failed_naming_and_left_nothing(airflow, local_cloud, run_id: str, cause: str) -> None:
    """The fault tests' end: the run's error names `cause`, and nothing of the slice is left."""
    error = _run_error(airflow, run_id)
    names = _names(airflow, run_id)
    left = [vm for vm in local_cloud.vms() if vm["name"].startswith(names["group_name"])]
    fault_tally.fault_injected()
    fault_tally.vms_left(left)
    fault_tally.failed_run(error, cause)
    assert cause in error
    assert _leftovers(names) == [] and left == []


def test_a_v6e_16_run_trains_on_every_host_and_leaves_nothing(shared_airflow, local_cloud, slice_reservation):
    from localcloud.connections import LOCAL_BUCKET

    local_cloud.clear_requests()
    run_id = shared_airflow.trigger(_conf(LOCAL_BUCKET), dag_id=DAG_ID)
    run = wait_for_run_end(shared_airflow, run_id, timeout=420, dag_id=DAG_ID)
    states = shared_airflow.task_states(run_id, DAG_ID)
    assert run["state"] == "success", states
    assert set(states.values()) == {"success"}, states

    hosts = shared_airflow.xcom(run_id, "create_slice", dag_id=DAG_ID)
    assert len(hosts) == HOSTS and [h["name"] for h in hosts] == sorted(h["name"] for h in hosts)
    names = _names(shared_airflow, run_id)
    assert all(h["name"].startswith(names["group_name"] + "-") for h in hosts)
    assert _leftovers(names) == []
    assert [vm for vm in local_cloud.vms() if vm["name"].startswith(names["group_name"])] == []
    training = shared_airflow.xcom(run_id, "wait_for_final_checkpoint", dag_id=DAG_ID)
    assert training["final_step"] == 12
    # The summary prices the slice: every host at the per-host price, for the group's life.
    vm = shared_airflow.xcom(run_id, "summarize_run", dag_id=DAG_ID)["vm"]
    assert vm["existed"] and vm["deleted"] and vm["hourly_price_usd"] == 4 * 10.0
    # The final checkpoint holds every host's part (each host's JAX process wrote its own), and
    # was committed after them.
    from maxtext_sft.cloud.storage import StorageEndpointHook

    files = StorageEndpointHook(gcp_conn_id="google_cloud_default").names_under(training["final_checkpoint"].rstrip("/"))
    parts = {name.split("/")[0] for name in files if name.startswith("ocdbt.process_")}
    assert parts == {f"ocdbt.process_{n}" for n in range(HOSTS)}, files

    # Every host was set up and trained (their commands went over SSH to each one); the
    # conversion and the export ran once.
    log = {task: _log(shared_airflow, run_id, task) for task in (
        "install_maxtext", "convert_checkpoint", "start_training", "export_to_hf")}
    for host in hosts:
        assert f"[{host['name']}] Running on {host['name']}: bash" in log["install_maxtext"]
        assert f"[{host['name']}] Running on {host['name']}: bash" in log["start_training"]
    assert log["convert_checkpoint"].count("Running on ") == 1
    assert log["export_to_hf"].count("Running on ") == 1

    # The bodies are gcloud's, but for the fields explained.
    requests = local_cloud.requests()
    captured = [r for step in json.loads(GCLOUD_SLICE.read_text())["steps"] for r in step["requests"]]
    gcloud = {
        "policy": _posts(captured, "resourcePolicies")[0],
        "template": _posts(captured, "instanceTemplates")[0],
        "group": _posts(captured, "instanceGroupManagers")[0],
    }
    ours = {
        "policy": _posts(requests, "resourcePolicies"),
        "template": _posts(requests, "instanceTemplates"),
        "group": _posts(requests, "instanceGroupManagers"),
    }
    assert {kind: len(bodies) for kind, bodies in ours.items()} == {"policy": 1, "template": 1, "group": 1}
    endpoint = local_cloud.compute_endpoint
    for kind in ("policy", "template", "group"):
        mine = _relative(ours[kind][0], endpoint)
        theirs = _relative(gcloud[kind], endpoint)
        # gcloud's example names a template, a reservation and a policy of its own; the run's are per run.
        theirs = json.loads(json.dumps(theirs).replace("my-slice-reservation", RESERVATION).replace(
            "my-project", names["project_id"]))
        assert _differences(mine, theirs, EXPLAINED_DIFFERENCES[kind]) == {}, kind
    assert ours["group"][0]["targetSize"] == HOSTS
    assert ours["policy"][0]["workloadPolicy"] == {"type": "HIGH_THROUGHPUT", "acceleratorTopology": "4x4"}
    # Each host's training knows every host by its internal address, in worker order.
    assert ",".join(h["ip"] for h in hosts) in log["start_training"]


def test_a_host_killed_mid_training_fails_the_run_naming_it_and_leaves_nothing(
    shared_airflow, local_cloud, slice_reservation
):
    from localcloud.connections import LOCAL_BUCKET

    local_cloud.set_vm_file("maxtext-faults.json", json.dumps({"seconds_per_step": 3}))
    try:
        run_id = shared_airflow.trigger(_conf(LOCAL_BUCKET, steps=40), dag_id=DAG_ID)
        try:
            wait_until(
                lambda: shared_airflow.task_states(run_id, DAG_ID).get("wait_for_final_checkpoint")
                in ("running", "deferred", "up_for_reschedule"),
                300,
                "training to be watched",
            )
        except AssertionError as timeout:
            raise AssertionError(f"{timeout}: {shared_airflow.task_states(run_id, DAG_ID)}") from None
        hosts = shared_airflow.xcom(run_id, "create_slice", dag_id=DAG_ID)
        killed = hosts[2]["name"]
        local_cloud.terminate_vm(killed, "DELETE")
        run = wait_for_run_end(shared_airflow, run_id, timeout=300, dag_id=DAG_ID)
    finally:
        local_cloud.set_vm_file("maxtext-faults.json", "{}")
    states = shared_airflow.task_states(run_id, DAG_ID)
    assert run["state"] == "failed"
    assert states["wait_for_final_checkpoint"] == "failed", states
    assert {states[t] for t in ("delete_slice", "delete_instance_template", "delete_workload_policy")} == {"success"}
    cause = f"({killed}) of slice"
    assert cause in _log(shared_airflow, run_id, "wait_for_final_checkpoint")
    _failed_naming_and_left_nothing(shared_airflow, local_cloud, run_id, cause)


def test_a_hosts_training_process_killed_fails_the_run_naming_that_host_and_leaves_nothing(
    shared_airflow, local_cloud, slice_reservation
):
    """The host stays up but its JAX process dies (an OOM kill, say): the others abort too, as
    JAX's coordination service makes them; the run names the host that died first."""
    from localcloud.connections import LOCAL_BUCKET

    faults = {"heartbeat_timeout_seconds": 5, "train_sft": {"kill_host_at_step": {"host": 1, "step": 3}}}
    local_cloud.set_vm_file("maxtext-faults.json", json.dumps(faults))
    try:
        run_id = shared_airflow.trigger(_conf(LOCAL_BUCKET), dag_id=DAG_ID)
        run = wait_for_run_end(shared_airflow, run_id, timeout=300, dag_id=DAG_ID)
    finally:
        local_cloud.set_vm_file("maxtext-faults.json", "{}")
    states = shared_airflow.task_states(run_id, DAG_ID)
    assert run["state"] == "failed"
    assert states["wait_for_final_checkpoint"] == "failed", states
    hosts = shared_airflow.xcom(run_id, "create_slice", dag_id=DAG_ID)
    _failed_naming_and_left_nothing(
        shared_airflow, local_cloud, run_id, f"exited with code 137 (killed by SIGKILL) on host 1 ({hosts[1]['name']})"
    )


def test_a_group_whose_hosts_cannot_be_made_fails_naming_the_cause_and_leaves_nothing(
    shared_airflow, local_cloud, slice_reservation
):
    from localcloud.connections import LOCAL_BUCKET

    local_cloud.set_faults({"insert_fails_after_accept": {"preset": "quota_exceeded"}})
    try:
        run_id = shared_airflow.trigger(_conf(LOCAL_BUCKET), dag_id=DAG_ID)
        run = wait_for_run_end(shared_airflow, run_id, timeout=300, dag_id=DAG_ID)
    finally:
        local_cloud.set_faults({})
    states = shared_airflow.task_states(run_id, DAG_ID)
    assert run["state"] == "failed"
    assert states["create_slice"] == "failed", states
    assert states["install_maxtext"] in ("upstream_failed", None), states
    cause = "QUOTA_EXCEEDED"
    assert "Compute Engine could not create host" in _log(shared_airflow, run_id, "create_slice")
    _failed_naming_and_left_nothing(shared_airflow, local_cloud, run_id, cause)
