"""SSH to the fine-tuning VM from a trigger: the SSH provider's `SSHHookAsync` (asyncssh), with the
VM's published host keys as the only ones it accepts.

As `VmSSHHook` (vm/ssh.py) does for the workers: the address and the host keys are the
VM's, known only at run time, so they are passed in; the connection gives the login and the
private key (extra `private_key`, or `key_file`), nothing else. A connection's
`no_host_key_check` or `host_key` never applies, neither does the triggerer's ~/.ssh (its
known_hosts, config, keys) nor an SSH agent.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping

from airflow.providers.common.compat.connection import get_async_connection
from airflow.providers.ssh.hooks.ssh import SSHHookAsync
from maxtext_sft.cloud.compute import HOST_KEY_TYPES

# asyncssh logs about ten INFO lines per connection (opened, auth, the command, closed): at every
# poll they would bury the training's own lines in the task's log. Its warnings still show.
logging.getLogger("asyncssh").setLevel(logging.WARNING)


def pinned_known_hosts(host: str, host_keys: Mapping[str, str]) -> bytes:
    """known_hosts lines for `host` with the VM's published keys (base64, validated by
    ComputeEngineEndpointHook.get_host_keys): the only keys asyncssh will accept."""
    lines = [f"{host} {kind} {host_keys[kind]}\n" for kind in HOST_KEY_TYPES if kind in host_keys]
    if not lines:
        raise ValueError(f"no usable SSH host key for {host} (got types {sorted(host_keys)})")
    return "".join(lines).encode()


class VmSSHHookAsync(SSHHookAsync):
    """One asyncssh connection to one VM at a time (`get_conn`); `connect_timeout` bounds the TCP
    connect, the handshake and the login together."""

    def __init__(
        self,
        *,
        ssh_conn_id: str,
        host: str,
        host_keys: Mapping[str, str],
        username: str | None = None,
        connect_timeout: float = 30,
        iap: Mapping | None = None,
    ):
        super().__init__(ssh_conn_id=ssh_conn_id, host=host, username=username, keepalive_interval=30)
        self.pinned = pinned_known_hosts(host, host_keys)
        self.known_hosts = self.pinned
        self.connect_timeout = connect_timeout
        self.iap = dict(iap) if iap else None  # cloud/iap_tunnel.py's target: SSH through IAP

    def _parse_extras(self, conn) -> None:
        """Only the key and its passphrase come from the connection's extras."""
        extra = conn.extra_dejson
        self.key_file = self.key_file or extra.get("key_file", "")
        self.private_key = extra.get("private_key", self.private_key)
        self.passphrase = extra.get("passphrase") or extra.get("private_key_passphrase") or self.passphrase
        self.known_hosts = self.pinned

    async def _get_conn(self):
        import asyncssh

        conn = await get_async_connection(self.ssh_conn_id)
        self._parse_extras(conn)
        options: dict = {
            "host": self.host,
            "port": self.port or conn.port or 22,
            "username": self.username or conn.login,
            "known_hosts": self.pinned,
            "keepalive_interval": self.keepalive_interval,
            "agent_path": None,  # no SSH agent: the connection's key only
            "config": None,  # nor the triggerer's ~/.ssh/config
        }
        if conn.password:
            options["password"] = conn.password
        if self.private_key:
            options["client_keys"] = [asyncssh.import_private_key(self.private_key, self.passphrase or None)]
        elif self.key_file:
            options["client_keys"] = [self.key_file]
            if self.passphrase:
                options["passphrase"] = self.passphrase
        else:
            options["client_keys"] = None  # not the triggerer's ~/.ssh keys
        if self.iap:
            from maxtext_sft.cloud.iap_tunnel import open_tunnel

            # Opened in a thread (a token refresh and a WebSocket handshake block), under the
            # Google connection's identity, in the triggerer itself: no gcloud there.
            options["sock"] = await asyncio.to_thread(open_tunnel, self.iap, self.connect_timeout, "triggerer")
        return await asyncio.wait_for(asyncssh.connect(**options), self.connect_timeout)
