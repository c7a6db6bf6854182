"""OS Login: import the pipeline's public key into the Google connection's login profile.

With the Param `os_login`, the VM's guest agent takes SSH keys from OS Login instead of the
instance metadata. The key is imported for the connection's account (a service account, usually)
with a short expiry at each connection, and the profile's POSIX username is the SSH login.
"""

from __future__ import annotations

import time

KEY_LIFETIME_SECONDS = 3600  # renewed at every connection; a leaked key stops working soon


def os_login_username(gcp_conn_id: str, public_key: str, project_id: str) -> str:
    """Import `public_key` ("TYPE BASE64") into the connection account's OS Login profile; return
    the POSIX username to log in as."""
    from airflow.providers.google.cloud.hooks.os_login import OSLoginHook  # imported when used: DAG files stay cheap to parse (docs/architecture.md)

    hook = OSLoginHook(gcp_conn_id=gcp_conn_id)
    expiry_usec = int((time.time() + KEY_LIFETIME_SECONDS) * 1_000_000)
    response = hook.import_ssh_public_key(
        user=hook._get_credentials_email,  # the provider's own accessor for the account's email
        ssh_public_key={"key": public_key, "expiration_time_usec": expiry_usec},
        project_id=project_id,
    )
    return response.login_profile.posix_accounts[0].username
