"""SSH through IAP under the Google connection's identity (cloud/iap_tunnel.py): a worker's paramiko
and a trigger's asyncssh reach a local-cloud VM through the emulator's relay, with an access token
the connection's service-account key got from the emulator's token endpoint; no gcloud involved."""

from __future__ import annotations

import asyncio
import json
import time
from datetime import datetime, timezone

import pytest

from localcloud.connections import LOCAL_PROJECT, LOCAL_RUN_CONF
from maxtext_sft.cloud.compute import ComputeEngineEndpointHook
from maxtext_sft.cloud.iap_tunnel import IapTunnelError, IapTunnelRefused, iap_target, open_tunnel
from maxtext_sft.run.spec import build_run_spec
from maxtext_sft.tasks.preflight import PreflightFailed, check_iap
from maxtext_sft.vm.ssh import VmSSHHook
from maxtext_sft.vm.ssh_async import VmSSHHookAsync

SSH_CONN_ID = "maxtext_sft_vm_ssh"
TUNNEL_USER = "airflow-runs@local-project.iam.gserviceaccount.com"
OUTSIDER = "someone-else@local-project.iam.gserviceaccount.com"


def google_connection(local_cloud, key: dict) -> str:
    """A Google connection with a service-account key, as a deployment would set it."""
    return json.dumps({"conn_type": "google_cloud_platform", "extra": {
        "keyfile_dict": json.dumps(key), "project": LOCAL_PROJECT,
        "compute_api_endpoint": local_cloud.compute_endpoint,
        "iap_tunnel_endpoint": local_cloud.iap_tunnel_endpoint,
        "resourcemanager_api_endpoint": local_cloud.resourcemanager_endpoint,
    }})


@pytest.fixture(scope="module")
def identities(pipeline_connections, local_cloud):
    """Connections `gcp_tunnel_user` (its account holds the Tunnel User role), `gcp_outsider` and
    `gcp_anonymous` (the relay's certificate is trusted through the local connections' SSL_CERT_FILE)."""
    mp = pytest.MonkeyPatch()
    for conn_id, email in (("gcp_tunnel_user", TUNNEL_USER), ("gcp_outsider", OUTSIDER)):
        mp.setenv(f"AIRFLOW_CONN_{conn_id.upper()}", google_connection(local_cloud, local_cloud.add_service_account(email)))
    mp.setenv("AIRFLOW_CONN_GCP_ANONYMOUS", json.dumps({"conn_type": "google_cloud_platform", "extra": {
        "project": LOCAL_PROJECT, "is_anonymous": True, "iap_tunnel_endpoint": local_cloud.iap_tunnel_endpoint}}))
    local_cloud.grant_iap_tunnel_user(LOCAL_PROJECT, f"serviceAccount:{TUNNEL_USER}")
    yield
    local_cloud.revoke_iap_tunnel_user(LOCAL_PROJECT, f"serviceAccount:{TUNNEL_USER}")
    mp.undo()


@pytest.fixture(scope="module")
def vm(identities):
    """A VM made from a RunSpec's insert body with ssh_via_iap (no external address)."""
    from airflow.providers.ssh.hooks.ssh import SSHHook

    key = SSHHook(ssh_conn_id=SSH_CONN_ID, remote_host="unused").pkey
    spec = build_run_spec(
        {"reservation": LOCAL_RUN_CONF["reservation"], "project_id": LOCAL_PROJECT, "ssh_via_iap": True},
        dag_id="iap_tests", run_id=f"manual__{time.time()}", generation=0, started=datetime.now(timezone.utc),
        default_project_id=None, ssh_user="maxtext", ssh_public_key=f"{key.get_name()} {key.get_base64()}",
    )
    compute = ComputeEngineEndpointHook(gcp_conn_id="google_cloud_default")
    where = {"zone": spec.zone, "project_id": spec.project_id}
    compute.insert_instance(body=spec.instance_body(), **where)
    try:
        address = compute.get_instance_address(resource_id=spec.vm_name, use_internal_ip=True, **where)
        yield spec, address, compute.get_host_keys(resource_id=spec.vm_name, **where)
    finally:
        compute.delete_instance(resource_id=spec.vm_name, **where)


def test_a_workers_ssh_goes_through_iap_as_the_connections_service_account(vm, local_cloud):
    spec, address, host_keys = vm
    target = iap_target("gcp_tunnel_user", spec.project_id, spec.zone, spec.vm_name)
    hook = VmSSHHook(ssh_conn_id=SSH_CONN_ID, remote_host=address, host_keys=host_keys, conn_timeout=20, iap=target)
    lines: list[str] = []
    with hook.get_conn():
        status, _ = hook.run_command("hostname", timeout=30, on_line=lines.append)
    assert (status, lines) == (0, [spec.vm_name])
    tunnels = [e for e in local_cloud.iap_requests() if e.get("instance") == spec.vm_name]
    assert tunnels and {(e["caller"], e["outcome"], e["port"]) for e in tunnels} == {(TUNNEL_USER, "connected", "22")}


def test_a_triggers_asyncssh_goes_through_iap_too(vm):
    spec, address, host_keys = vm
    hook = VmSSHHookAsync(ssh_conn_id=SSH_CONN_ID, host=address, host_keys=host_keys, connect_timeout=20,
                          iap=iap_target("gcp_tunnel_user", spec.project_id, spec.zone, spec.vm_name))

    async def run() -> str:
        async with await hook._get_conn() as conn:
            return (await conn.run("echo through-iap", check=True)).stdout.strip()

    assert asyncio.run(run()) == "through-iap"


def test_iap_refusing_the_identity_fails_naming_the_role_and_the_account(vm):
    spec, _, _ = vm
    with pytest.raises(IapTunnelRefused, match=rf"4033: 'not authorized'.*{OUTSIDER} needs the IAP-secured Tunnel User"):
        open_tunnel(iap_target("gcp_outsider", spec.project_id, spec.zone, spec.vm_name), timeout=20)
    # Anonymous credentials have no token to give.
    with pytest.raises(IapTunnelRefused, match="anonymous: SSH through IAP needs an identity"):
        open_tunnel(iap_target("gcp_anonymous", spec.project_id, spec.zone, spec.vm_name), timeout=20)


def test_a_vm_that_is_not_there_yet_is_unreachable_not_refused(vm):
    spec, _, _ = vm
    with pytest.raises(IapTunnelError, match="4047: 'Failed to lookup instance'") as raised:
        open_tunnel(iap_target("gcp_tunnel_user", spec.project_id, spec.zone, "not-made-yet"), timeout=20)
    assert isinstance(raised.value, OSError)  # what the waits for SSH read as "not reachable yet"


def test_preflight_asks_iam_whether_the_connection_may_tunnel_before_any_vm(vm):
    spec, _, _ = vm
    assert check_iap("gcp_tunnel_user", spec).startswith(f"{TUNNEL_USER} may tunnel to project {spec.project_id}")
    with pytest.raises(PreflightFailed, match=rf"{OUTSIDER} .* may not tunnel .* IAP-secured Tunnel User"):
        check_iap("gcp_outsider", spec)
    with pytest.raises(PreflightFailed, match="is anonymous"):
        check_iap("gcp_anonymous", spec)
