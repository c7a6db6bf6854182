"""OS Login keys across a wait longer than their lifetime, against a VM of the local cloud that takes
only unexpired profile keys: the worker imports the key (ssh_target), a trigger that polls past
its expiry without renewing it is refused the login, one that renews it from the triggerer logs in;
and the trigger carries what it renews from through serialization."""

from __future__ import annotations

import time
from datetime import datetime, timezone

import pytest
from google.api_core.exceptions import NotFound

from localcloud.connections import LOCAL_PROJECT, LOCAL_RUN_CONF, LOCAL_SERVICE_ACCOUNT
from maxtext_sft.cloud.compute import ComputeEngineEndpointHook
from maxtext_sft.cloud.os_login import renewal_due
from maxtext_sft.run.spec import build_run_spec
from maxtext_sft.vm.access import ssh_target
from maxtext_sft.vm.ssh_ready import SshReadyTrigger
from tests.plugins.test_training_trigger import GCP_CONN_ID, SSH_CONN_ID, first_event

LIFETIME = 20  # the Param's minimum


def os_login_spec(name: str):
    from airflow.providers.ssh.hooks.ssh import SSHHook

    key = SSHHook(ssh_conn_id=SSH_CONN_ID, remote_host="unused").pkey
    return build_run_spec(
        {"reservation": LOCAL_RUN_CONF["reservation"], "project_id": LOCAL_PROJECT, "steps": 5,
         "os_login": True, "os_login_key_lifetime_seconds": LIFETIME},
        dag_id="os_login_tests", run_id=f"manual__{name}_{time.time()}", generation=0,
        started=datetime.now(timezone.utc), default_project_id=None, ssh_user="maxtext",
        ssh_public_key=f"{key.get_name()} {key.get_base64()}",
    )


@pytest.fixture
def os_login_vm(pipeline_connections, local_cloud):
    spec = os_login_spec("renewal")
    compute = ComputeEngineEndpointHook(gcp_conn_id=GCP_CONN_ID)
    where = {"zone": spec.zone, "project_id": spec.project_id}
    compute.insert_instance(body=spec.instance_body(), **where)
    try:
        deadline = time.monotonic() + 60
        while not compute.get_host_keys(resource_id=spec.vm_name, **where):
            assert time.monotonic() < deadline, "no host keys published"
            time.sleep(0.5)  # polling interval: the guest agent publishes them after boot
        yield spec
    finally:
        try:
            compute.delete_instance(resource_id=spec.vm_name, **where)
        except NotFound:
            pass


def ready_trigger(spec, target: dict) -> SshReadyTrigger:
    return SshReadyTrigger(
        ssh_conn_id=SSH_CONN_ID, **target, vm_name=spec.vm_name, project_id=spec.project_id, zone=spec.zone,
        gcp_conn_id=GCP_CONN_ID, poll_interval=0.5, first_poll_after=0, deadline=time.time() + 30, connect_timeout=5,
    )


def test_a_trigger_renews_the_key_past_its_lifetime_and_one_that_does_not_is_refused(os_login_vm, local_cloud):
    spec = os_login_vm
    local_cloud.clear_oslogin_requests()
    target = ssh_target(spec, GCP_CONN_ID)  # the worker's import, for LIFETIME seconds
    assert target["username"].startswith("sa_") and target["os_login"]["lifetime_seconds"] == LIFETIME
    imported = local_cloud.oslogin_requests()
    assert [r["api_client"].split()[0] for r in imported] == ["maxtext-sft-worker"]
    assert LOCAL_SERVICE_ACCOUNT in imported[0]["path"].replace("%40", "@")
    assert imported[0]["body"]["key"] == spec.ssh_public_key  # the public key, nothing else

    assert first_event(ready_trigger(spec, target))["status"] == "ready"  # the fresh key logs in
    classpath, kwargs = ready_trigger(spec, target).serialize()
    assert kwargs["os_login"] == target["os_login"] and kwargs["username"] == target["username"]

    expires_at = target["os_login"]["expires_at"]
    while time.time() <= expires_at + 0.5:  # the key's lifetime passes, as under a long wait
        time.sleep(0.5)
    assert renewal_due(target["os_login"])
    without_renewal = ready_trigger(spec, {**target, "os_login": None})
    event = first_event(without_renewal)
    assert event["status"] == "refused" and event["kind"] == "login", event

    local_cloud.clear_oslogin_requests()
    renewing = ready_trigger(spec, target)
    assert first_event(renewing)["status"] == "ready"
    renewed = local_cloud.oslogin_requests()
    assert renewed and {r["api_client"].split()[0] for r in renewed} == {"maxtext-sft-triggerer"}, renewed
    assert renewing.os_login["expires_at"] > time.time() + LIFETIME / 2


def test_renewal_is_due_once_half_the_lifetime_passed():
    login = {"public_key": "ssh-ed25519 AAAA", "project_id": "p", "lifetime_seconds": 3600, "expires_at": 10_000.0}
    assert not renewal_due(login, now=10_000 - 1801)
    assert renewal_due(login, now=10_000 - 1799)
    assert renewal_due(login, now=10_001)


def test_a_reimport_that_keeps_the_earlier_expiry_is_followed_by_an_update_of_the_expiry():
    """Whatever a re-import does with a key the profile holds, the renewed expiry takes: when the
    answer shows the earlier one, the key's expiry is set with updateSshPublicKey."""
    from google.cloud.oslogin_v1 import ImportSshPublicKeyResponse

    from maxtext_sft.cloud.os_login import OsLoginEndpointHook

    key = "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIIW1"
    calls = []

    class Client:
        def import_ssh_public_key(self, parent, ssh_public_key, project_id):
            calls.append(("import", parent, ssh_public_key["expiration_time_usec"]))
            return ImportSshPublicKeyResponse(login_profile={
                "name": "sa@p.iam.gserviceaccount.com",
                "posix_accounts": [{"username": "sa_1", "uid": 4000, "account_id": project_id, "primary": True}],
                "ssh_public_keys": {"fp1": {"key": key, "expiration_time_usec": 5, "fingerprint": "fp1"}},
            })

        def update_ssh_public_key(self, name, ssh_public_key, update_mask):
            calls.append(("update", name, ssh_public_key["expiration_time_usec"], update_mask["paths"]))

    hook = OsLoginEndpointHook.__new__(OsLoginEndpointHook)  # no connection: the client and account given
    hook.__dict__.update(client=Client(), account="sa@p.iam.gserviceaccount.com", caller="worker")
    imported = hook.import_key(key, "p", 60)
    assert imported["username"] == "sa_1"
    [(_, parent, expiry), (_, name, updated, paths)] = calls
    assert parent == "users/sa@p.iam.gserviceaccount.com" and name == "users/sa@p.iam.gserviceaccount.com/sshPublicKeys/fp1"
    assert updated == expiry == int(imported["expires_at"] * 1_000_000) and paths == ["expiration_time_usec"]


def test_each_host_of_a_slice_renews_from_its_own_arguments():
    from maxtext_sft.vm.training_watch import SliceTrainingStatusTrigger, TrainingStatusTrigger

    login = {"public_key": "ssh-ed25519 AAAA", "project_id": "p", "lifetime_seconds": 60, "expires_at": 1.0}
    host = dict(ssh_conn_id="s", host="10.0.0.2", host_keys={"ssh-ed25519": "AAAA"}, vm_name="h1", project_id="p",
                zone="z", gcp_conn_id="g", poll_interval=1, deadline=2, username="sa_1", os_login=login,
                command="true", run_name="r", stall_timeout_seconds=60)
    _, kwargs = SliceTrainingStatusTrigger(hosts=[host, {**host, "vm_name": "h2"}], instance_ids={}).serialize()
    assert all(TrainingStatusTrigger(**h).os_login == login for h in kwargs["hosts"])
