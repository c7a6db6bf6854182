"""OS Login: import the pipeline's public key into the Google connection's login profile, and keep
it valid while a wait still logs in.

With the Param `os_login`, the VM's guest agent takes SSH keys from OS Login instead of the
instance metadata: sshd asks for the profile's keys at each login and takes only those whose
expiry has not passed (guest-oslogin's google_authorized_keys). The key is imported for the
connection's account (a service account, usually) for `os_login_key_lifetime_seconds` (an hour
by default) at each connection a worker sets up, and a wait that logs in again and again (the
SSH readiness and training triggers, on every host of a slice) renews it once half of its
lifetime has passed: a leaked key stops working soon after the run, and a twelve-hour training
is never refused its login. Only the PUBLIC key is imported; the private key stays in the SSH
connection.

`OsLoginEndpointHook` owns one google-cloud-os-login client (REST transport) whose endpoint comes
from the Google connection extra `oslogin_api_endpoint` (gcloud's api_endpoint_overrides/oslogin
format: the host root, e.g. `https://oslogin.googleapis.com/`, the oslogin v1 discovery
document's rootUrl with its empty servicePath), as `compute_api_endpoint` sets the Compute API's
(cloud/compute.py). The REST transport, not gRPC: the override is a URL, as the other APIs' are. The account is the connection's credentials' email, or the extra
`os_login_account` where the credentials have none to tell (anonymous ones, some federated ones).
"""

from __future__ import annotations

import time
from functools import cached_property
from typing import Any

from airflow.providers.google.common.hooks.base_google import GoogleBaseHook
from maxtext_sft.cloud.endpoints import endpoint_override

KEY_LIFETIME_SECONDS = 3600  # the Param os_login_key_lifetime_seconds' default
# A wait renews the key once less than this share of its lifetime is left.
RENEW_WHEN_LEFT = 0.5


class OsLoginEndpointHook(GoogleBaseHook):
    """The OS Login API for the connection's account. `caller` names who asks ("worker" or
    "triggerer") in the client's user agent (the x-goog-api-client header), for the API's logs."""

    def __init__(self, gcp_conn_id: str = "google_cloud_default", *, caller: str = "worker", **kwargs):
        super().__init__(gcp_conn_id=gcp_conn_id, **kwargs)
        self.caller = caller

    @cached_property
    def oslogin_api_endpoint(self) -> str | None:
        return endpoint_override(self, "oslogin_api_endpoint", "")

    @cached_property
    def client(self):
        from google.api_core.gapic_v1.client_info import ClientInfo
        from google.api_core.client_options import ClientOptions
        from google.cloud.oslogin_v1 import OsLoginServiceClient  # imported when used: DAG files stay cheap to parse

        endpoint = self.oslogin_api_endpoint
        return OsLoginServiceClient(
            credentials=self.get_credentials(),
            transport="rest",
            client_options=ClientOptions(api_endpoint=endpoint.rstrip("/")) if endpoint else None,
            client_info=ClientInfo(user_agent=f"maxtext-sft-{self.caller}"),
        )

    def close(self) -> None:
        """Close the client's HTTP session (a hook made for one import leaves no socket behind)."""
        if "client" in self.__dict__:
            self.__dict__.pop("client").transport.close()

    @cached_property
    def account(self) -> str:
        """The Google account whose login profile gets the key."""
        return self._get_field("os_login_account", None) or self._get_credentials_email

    def import_key(self, public_key: str, project_id: str, lifetime_seconds: float) -> dict[str, Any]:
        """Import `public_key` ("TYPE BASE64") for `lifetime_seconds` from now; returns
        {"username": the POSIX username to log in as, "expires_at": epoch seconds}.

        Importing a key the profile already holds asks for the new expiry; if the answer still
        shows an earlier one, the key's expiry is set with updateSshPublicKey (the API's method for
        it), so a renewal never depends on how a re-import treats an existing key."""
        expiry_usec = int((time.time() + lifetime_seconds) * 1_000_000)
        profile = self.client.import_ssh_public_key(
            parent=f"users/{self.account}",
            ssh_public_key={"key": public_key, "expiration_time_usec": expiry_usec},
            project_id=project_id,
        ).login_profile
        blob = public_key.split()[:2]
        for fingerprint, stored in profile.ssh_public_keys.items():
            if stored.key.split()[:2] == blob and stored.expiration_time_usec < expiry_usec:
                self.client.update_ssh_public_key(
                    name=f"users/{self.account}/sshPublicKeys/{fingerprint}",
                    ssh_public_key={"expiration_time_usec": expiry_usec},
                    update_mask={"paths": ["expiration_time_usec"]},
                )
        accounts = list(profile.posix_accounts)
        if not accounts:
            raise RuntimeError(f"OS Login gave account {self.account} no POSIX account in project {project_id}")
        account = next((a for a in accounts if a.account_id == project_id), None) or next(
            (a for a in accounts if a.primary), accounts[0])
        return {"username": account.username, "expires_at": expiry_usec / 1_000_000}


def os_login_key(spec, gcp_conn_id: str, *, caller: str = "worker") -> dict[str, Any]:
    """Import the run's public key for `spec`'s (a RunSpec) key lifetime. Returns
    {"username", "os_login"}: `os_login` is what a trigger renews the key from (plain values:
    the public key, the project, the lifetime, when it expires)."""
    lifetime = float(spec.os_login_key_lifetime_seconds)
    imported = _import_once(gcp_conn_id, caller, spec.ssh_public_key, spec.project_id, lifetime)
    return {
        "username": imported["username"],
        "os_login": {
            "public_key": spec.ssh_public_key,
            "project_id": spec.project_id,
            "lifetime_seconds": lifetime,
            "expires_at": imported["expires_at"],
        },
    }


def renewal_due(os_login: dict[str, Any], now: float | None = None) -> bool:
    """Whether a key imported as `os_login` says should be renewed before the next login."""
    left = os_login["expires_at"] - (time.time() if now is None else now)
    return left < os_login["lifetime_seconds"] * RENEW_WHEN_LEFT


def renew_key(gcp_conn_id: str, os_login: dict[str, Any], *, caller: str) -> dict[str, Any]:
    """Import the key again for its lifetime; `os_login` with the new expiry. Blocking: a trigger
    runs it in a thread."""
    imported = _import_once(
        gcp_conn_id, caller, os_login["public_key"], os_login["project_id"], os_login["lifetime_seconds"]
    )
    return {**os_login, "expires_at": imported["expires_at"]}


def _import_once(gcp_conn_id: str, caller: str, public_key: str, project_id: str, lifetime: float) -> dict[str, Any]:
    hook = OsLoginEndpointHook(gcp_conn_id=gcp_conn_id, caller=caller)
    try:
        return hook.import_key(public_key, project_id, lifetime)
    finally:
        hook.close()
