"""The emulator's IAP TCP forwarding and token endpoint, driven by the real clients: gcloud's
`start-iap-tunnel` (pointed at the relay with its --iap-tunnel-url-override) and google-auth's
service-account credentials (the key file's token_uri). localcloud/iap names the sources."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import time
from pathlib import Path

import pytest

from google.auth.exceptions import RefreshError
from google.auth.transport.requests import Request
from google.oauth2 import service_account

from tests.gcloud import gcloud_runner
from tests.localcloud.conftest import COMPUTE_PROJECT, COMPUTE_ZONE

SCOPES = ["https://www.googleapis.com/auth/cloud-platform"]
TUNNEL_USER = "tunnel-user@lc-test-project.iam.gserviceaccount.com"
OUTSIDER = "outsider@lc-test-project.iam.gserviceaccount.com"


def token_of(key: dict) -> str:
    credentials = service_account.Credentials.from_service_account_info(key, scopes=SCOPES)
    credentials.refresh(Request())
    return credentials.token


@pytest.fixture(scope="module")
def keys(compute_cloud):
    """A service account with the Tunnel User role on the test project, and one without it."""
    keys = {email: compute_cloud.add_service_account(email) for email in (TUNNEL_USER, OUTSIDER)}
    compute_cloud.grant_iap_tunnel_user(COMPUTE_PROJECT, f"serviceAccount:{TUNNEL_USER}")
    return keys


def start_tunnel(cloud, tmp_path: Path, instance: str, token: str) -> subprocess.Popen:
    """gcloud's tunnel to `instance`'s port 22 on stdin/stdout, as an SSH ProxyCommand runs it."""
    runner_env = gcloud_runner(tmp_path / "gcloud", cloud.compute_endpoint)  # checks gcloud is there
    del runner_env
    command = (f"gcloud compute start-iap-tunnel {instance} 22 --listen-on-stdin --zone={COMPUTE_ZONE} "
               f"--project={COMPUTE_PROJECT} --iap-tunnel-url-override={cloud.iap_tunnel_endpoint} --verbosity=warning")
    env = {**os.environ, "CLOUDSDK_CONFIG": str(tmp_path / "gcloud"), "CLOUDSDK_AUTH_ACCESS_TOKEN": token,
           "CLOUDSDK_CORE_CUSTOM_CA_CERTS_FILE": cloud.iap_tunnel_ca_file,
           "CLOUDSDK_API_ENDPOINT_OVERRIDES_COMPUTE": cloud.compute_endpoint, "CLOUDSDK_CORE_DISABLE_PROMPTS": "1",
           "CLOUDSDK_CORE_DISABLE_USAGE_REPORTING": "true", "CLOUDSDK_COMPONENT_MANAGER_DISABLE_UPDATE_CHECK": "true",
           "CLOUDSDK_CORE_CHECK_GCE_METADATA": "false", "GCE_METADATA_ROOT": "127.0.0.1:1", "GCE_METADATA_IP": "127.0.0.1:1"}
    return subprocess.Popen(shlex.split(command), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, env=env, start_new_session=True)


def test_the_token_endpoint_takes_a_registered_key_and_refuses_others(compute_cloud, keys):
    assert token_of(keys[TUNNEL_USER]).startswith("ya29.")
    # A key of the same account that was never registered (rotated, deleted) is refused, as Google does.
    forged = {**keys[TUNNEL_USER], "private_key": compute_cloud.add_service_account(
        "other@lc-test-project.iam.gserviceaccount.com")["private_key"]}
    with pytest.raises(RefreshError, match="Invalid JWT Signature"):
        token_of(forged)
    unknown = {**keys[TUNNEL_USER], "client_email": "gone@lc-test-project.iam.gserviceaccount.com"}
    with pytest.raises(RefreshError, match="account not found"):
        token_of(unknown)


def test_gcloud_tunnels_to_the_vms_sshd_for_a_tunnel_user(compute_cloud, compute_vm, keys, tmp_path):
    compute_vm("iap-vm")
    compute_cloud.clear_requests()
    tunnel = start_tunnel(compute_cloud, tmp_path, "iap-vm", token_of(keys[TUNNEL_USER]))
    try:
        tunnel.stdin.write(b"SSH-2.0-localcloud-test\r\n")
        tunnel.stdin.flush()
        banner = tunnel.stdout.readline()
    finally:
        tunnel.stdin.close()
        tunnel.wait(30)
    assert banner.startswith(b"SSH-2.0-OpenSSH"), (banner, tunnel.stderr.read())
    [entry] = [e for e in compute_cloud.iap_requests() if e["instance"] == "iap-vm"]
    assert (entry["caller"], entry["outcome"], entry["port"], entry["interface"]) == (TUNNEL_USER, "connected", "22", "nic0")


def test_gcloud_reports_the_refusals_as_for_the_real_relay(compute_cloud, compute_vm, keys, tmp_path):
    compute_vm("iap-vm-refused")
    for token, said in ((token_of(keys[OUTSIDER]), "4033: 'not authorized'"), ("ya29.not-issued", "Handshake status 401")):
        tunnel = start_tunnel(compute_cloud, tmp_path, "iap-vm-refused", token)
        stdout, stderr = tunnel.communicate(b"SSH-2.0-localcloud-test\r\n", timeout=60)
        # (--listen-on-stdin reports the refusal and exits 0, as in public captures of its output)
        assert said in stderr.decode() and not stdout, stderr.decode()
    outcomes = [e["outcome"] for e in compute_cloud.iap_requests() if e.get("instance") == "iap-vm-refused"]
    assert 4033 in outcomes and 401 not in outcomes  # a 401 never reaches the query's parsing
