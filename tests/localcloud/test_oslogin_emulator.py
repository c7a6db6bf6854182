"""The OS Login emulator through google-cloud-os-login's REST client, and a VM with OS Login that
takes only the keys of the login profile whose expiry has not passed (paramiko for the logins)."""

from __future__ import annotations

import time
from urllib.parse import unquote

import paramiko
import pytest
from googleapiclient.errors import HttpError

from localcloud.compute.testing import instance_body, wait_operation
from localcloud.oslogin.store import posix_username
from tests.localcloud.test_compute_emulator import ZONE, run, ssh

pytestmark = pytest.mark.e2e

PROJECT = "lc-oslogin-expiry"
ACCOUNT = "runner@lc-oslogin-expiry.iam.gserviceaccount.com"


def os_login_client(cloud):
    from google.api_core.client_options import ClientOptions
    from google.auth.credentials import AnonymousCredentials
    from google.cloud.oslogin_v1 import OsLoginServiceClient

    return OsLoginServiceClient(
        credentials=AnonymousCredentials(), transport="rest",
        client_options=ClientOptions(api_endpoint=cloud.oslogin_endpoint.rstrip("/")),
    )


def public_line(key: paramiko.PKey) -> str:
    return f"{key.get_name()} {key.get_base64()}"


def usec(seconds_from_now: float) -> int:
    return int((time.time() + seconds_from_now) * 1_000_000)


def test_the_rest_client_imports_reads_updates_and_deletes_keys(compute_cloud):
    from google.api_core.exceptions import BadRequest, NotFound

    client = os_login_client(compute_cloud)
    compute_cloud.clear_oslogin_requests()
    pkey = paramiko.ECDSAKey.generate()
    expiry = usec(600)
    response = client.import_ssh_public_key(
        parent=f"users/{ACCOUNT}", ssh_public_key={"key": public_line(pkey), "expiration_time_usec": expiry},
        project_id=PROJECT,
    )
    [account] = response.login_profile.posix_accounts
    assert account.username == posix_username(ACCOUNT) and account.username.startswith("sa_")
    assert account.username[3:].isdigit() and account.uid >= 1000 and account.account_id == PROJECT
    [(fingerprint, stored)] = response.login_profile.ssh_public_keys.items()
    assert stored.key == public_line(pkey) and stored.expiration_time_usec == expiry

    name = f"users/{ACCOUNT}/sshPublicKeys/{fingerprint}"
    assert client.get_ssh_public_key(name=name).expiration_time_usec == expiry
    later = usec(1200)
    updated = client.update_ssh_public_key(
        name=name, ssh_public_key={"expiration_time_usec": later}, update_mask={"paths": ["expiration_time_usec"]}
    )
    assert updated.expiration_time_usec == later and updated.key == public_line(pkey)
    assert client.get_login_profile(name=f"users/{ACCOUNT}").ssh_public_keys[fingerprint].expiration_time_usec == later

    with pytest.raises(BadRequest, match="INVALID_ARGUMENT|invalid argument"):
        client.import_ssh_public_key(parent=f"users/{ACCOUNT}", ssh_public_key={"key": "not a key"}, project_id=PROJECT)
    client.delete_ssh_public_key(name=name)
    with pytest.raises(NotFound):
        client.get_ssh_public_key(name=name)

    logged = compute_cloud.oslogin_requests()
    assert [(r["method"], r["status"]) for r in logged] == [
        ("POST", 200), ("GET", 200), ("PATCH", 200), ("GET", 200), ("POST", 400), ("DELETE", 200), ("GET", 404)]
    assert unquote(logged[0]["path"]) == f"/v1/users/{ACCOUNT}:importSshPublicKey" and logged[0]["query"]["projectId"] == PROJECT
    assert logged[0]["body"]["expirationTimeUsec"] == str(expiry)
    assert "PRIVATE" not in str(logged)


def test_a_vm_with_os_login_refuses_a_key_once_its_expiry_passed(compute_cloud, compute_discovery):
    client = os_login_client(compute_cloud)
    instances = compute_discovery.instances()
    where = {"project": PROJECT, "zone": ZONE}
    metadata_key, os_login_key = paramiko.ECDSAKey.generate(), paramiko.ECDSAKey.generate()
    name = "lc-oslogin-expiry"
    body = instance_body(name, zone=ZONE, metadata={
        "enable-oslogin": "TRUE", "ssh-keys": f"maxtext:{public_line(metadata_key)}"})
    done = wait_operation(compute_discovery, instances.insert(body=body, **where).execute(), **where)
    assert "error" not in done, done
    try:
        ip = instances.get(instance=name, **where).execute()["networkInterfaces"][0]["networkIP"]
        lifetime = 6
        response = client.import_ssh_public_key(
            parent=f"users/{ACCOUNT}", project_id=PROJECT,
            ssh_public_key={"key": public_line(os_login_key), "expiration_time_usec": usec(lifetime)},
        )
        expires = response.login_profile.ssh_public_keys
        expires_at = max(k.expiration_time_usec for k in expires.values()) / 1_000_000
        user = response.login_profile.posix_accounts[0].username
        with ssh(ip, user, os_login_key) as session:
            # The account resolves as NSS would resolve it, with its home, and may use sudo.
            assert run(session, "id -un; echo $HOME").split() == [user, f"/home/{user}"]
            assert "google-sudoers" in run(session, "id -Gn")
        # OS Login on: the ssh-keys metadata makes no user, whatever its key.
        with pytest.raises(paramiko.AuthenticationException):
            ssh(ip, "maxtext", metadata_key)
        # A key not in the profile is refused for the OS Login user too.
        with pytest.raises(paramiko.AuthenticationException):
            ssh(ip, user, metadata_key)

        while time.time() <= expires_at + 0.5:  # past the key's expiry (by the guest's clock, the same)
            time.sleep(0.5)
        with pytest.raises(paramiko.AuthenticationException):
            ssh(ip, user, os_login_key)
        # Imported again with a new expiry: the same key logs in again.
        client.import_ssh_public_key(
            parent=f"users/{ACCOUNT}", project_id=PROJECT,
            ssh_public_key={"key": public_line(os_login_key), "expiration_time_usec": usec(600)},
        )
        with ssh(ip, user, os_login_key) as session:
            assert run(session, "id -un").strip() == user
    finally:
        try:
            wait_operation(compute_discovery, instances.delete(instance=name, **where).execute(), **where)
        except HttpError as exc:
            if exc.resp.status != 404:
                raise
