"""Wait for a new VM's SSH login on the triggerer: `true` over SSH, every poll, until the worker is needed.

Each poll reads the host keys the VM publishes from the Compute API, then opens one SSH connection
to the VM as the pipeline's user (vm/ssh_async.py: asyncssh, only those keys are accepted) and
runs `true`, a fixed command: nothing of the run reaches the VM's shell. The keys are pinned once
they have settled (vm.access.host_keys_settled: the same at two reads in a row, the login with
them working): a new VM's keys can change during its first boot. `host_keys` are the ones the
worker read last ({} for none).

Events (one, then the trigger ends):
  {"status": "ready", "host_keys": {...}}   the login worked with keys that settled: the worker
      pins them and starts the VM's autostop
  {"status": "refused", "kind": "host_key", "message": ...}   not the VM's host key, with the same
      keys published for vm.access.HOST_KEY_MISMATCH_GRACE_SECONDS: the worker fails the task, as
      VmSSHHook's error does
  {"status": "refused", "kind": "login", "message": ..., "first_refused": T}   its sshd refused
      the login (T: when a login was first refused, epoch seconds). Before `refused_until` (the
      worker's grace for a guest agent still making the user) a refusal is polled on; the worker
      judges it as SshLoginProbe does (OS Login, vm.access.LOGIN_GRACE_SECONDS)
  {"status": "unreachable", "error_type": ..., "error": ...}   `deadline` (ssh_ready_timeout_seconds)
      passed without a login: the last error that said the VM did not answer (its type's name and
      text; None and "" when none did), for the worker's message
  {"status": "look_again"}   the Compute API says the VM is gone or stopped: the worker checks
      again (and is done: the next step makes the VM again)
No event leaves before `first_event_after` seconds from the trigger's start (vm/trigger_ssh.py:
apache/airflow#72716); the polls do not wait.

A slice's hosts: `SliceSshReadyTrigger` runs one host's logins per host at once, until every host
takes the login or one needs the worker; its event names the hosts ready and each other host's
event (see that class).
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from maxtext_sft.vm.trigger_ssh import HeldEventTrigger, VmSshTrigger, cancel_all

COMMAND = "true"  # the login's only command


class SshReadyTrigger(VmSshTrigger):
    """Try the pipeline's SSH login every `poll_interval` (the first after `first_poll_after`)."""

    def __init__(
        self,
        *,
        refused_until: float | None = None,
        first_refused: float | None = None,
        command_timeout: float = 60,
        **kwargs,  # VmSshTrigger's: where the VM is, how to log in, the polls' pace and deadline
    ):
        super().__init__(command_timeout=command_timeout, **kwargs)
        self.refused_until = None if refused_until is None else float(refused_until)
        self.first_refused = None if first_refused is None else float(first_refused)

    def _kwargs(self) -> dict[str, Any]:
        return {**super()._kwargs(), "refused_until": self.refused_until, "first_refused": self.first_refused}

    def _host_keys(self) -> dict[str, str]:
        """The keys the VM published; raises HostKeysNotPublished, also when the Compute API could
        not be read this time (the next poll reads again). Blocking: run in a thread."""
        from maxtext_sft.vm.access import HostKeysNotPublished, published_host_keys

        try:
            return published_host_keys(self.gcp_conn_id, self.vm_name, self.zone, self.project_id)
        except HostKeysNotPublished:
            raise
        except Exception as error:  # noqa: BLE001 - a read that fails says nothing about the VM
            raise HostKeysNotPublished(f"could not read the SSH host keys of VM {self.vm_name}: {error}") from error

    async def _login(self, host_keys: dict[str, str]) -> int:
        """One connection, one `true`: its exit status."""
        await self._renew_os_login_key()
        async with await self._hook(host_keys).get_conn() as conn:  # closed on leaving, a cancelled login's too
            result = await conn.run(COMMAND, check=False, timeout=self.command_timeout)
        return result.exit_status if result.exit_status is not None else -1

    async def _watch(self) -> dict[str, Any]:
        """Poll until something needs the worker: the event's payload."""
        import asyncssh

        from maxtext_sft.vm.access import HostKeysNotPublished, host_keys_settled, key_fingerprints
        from maxtext_sft.vm.ssh_common import HostKeyMismatch

        unreachable = (HostKeysNotPublished, OSError, EOFError, asyncio.TimeoutError, asyncssh.Error)
        # The keys of the last read whose login met one of them (given: the worker's); the keys
        # published while sshd has shown another key, and since when (vm.access.host_keys_settled).
        previous, first_refused = self.host_keys, self.first_refused
        mismatched: tuple[dict[str, str], float] | None = None
        last_error: BaseException | None = None
        pause = self.first_poll_after
        while True:
            await asyncio.sleep(max(0.0, min(pause, self.deadline - time.time())))
            pause = self.poll_interval
            host_keys: dict[str, str] = {}
            try:
                host_keys = await asyncio.to_thread(self._host_keys)
                status = await self._login(host_keys)
                if status == 0:
                    settled = host_keys_settled(previous, host_keys, None)
                    previous, mismatched = host_keys, None
                    if settled:
                        self.log.info("VM %s accepts the SSH login; host keys pinned (%s)", self.vm_name,
                                      key_fingerprints(host_keys))
                        return {"status": "ready", "host_keys": host_keys}
                    self.log.info("VM %s accepts the SSH login with host keys %s: reading them again to see "
                                  "that they stay", self.vm_name, key_fingerprints(host_keys))
                else:
                    self.log.warning("`%s` exited %s on VM %s", COMMAND, status, self.vm_name)
            except asyncssh.HostKeyNotVerifiable as error:
                message = (
                    f"SSH host key of {self.host} is not the {' or '.join(sorted(host_keys))} key the VM published "
                    f"in its guest attributes (hostkeys/): refusing to connect to {self.vm_name} ({error})"
                )
                if not mismatched or mismatched[0] != host_keys:
                    mismatched = (host_keys, time.time())
                try:
                    host_keys_settled(previous, host_keys, HostKeyMismatch(message), mismatched[1])
                except HostKeyMismatch as mismatch:  # too long with the same keys: not a first boot's change
                    return {"status": "refused", "kind": "host_key", "message": str(mismatch)}
                previous, last_error = None, HostKeyMismatch(message)
                self.log.info("VM %s: its sshd shows a host key it has not published (yet), as during a first "
                              "boot: reading them again (%s)", self.vm_name, message)
            except asyncssh.PermissionDenied as error:
                previous, mismatched = host_keys, None  # refused after the host key check: it matched
                message = f"{self.host} refused the SSH login with the connection's key: {error}"
                first_refused = first_refused or time.time()
                if self.refused_until is None or time.time() >= self.refused_until:
                    return {"status": "refused", "kind": "login", "message": message, "first_refused": first_refused}
                self.log.info("VM %s refused the login, maybe before its guest agent made the user: %s",
                              self.vm_name, message)
            except unreachable as error:
                last_error = error
                self.log.info("VM %s does not answer SSH yet: %s: %s", self.vm_name, type(error).__name__, error)
                if await self._vm_lost():
                    return {"status": "look_again"}
            if time.time() >= self.deadline:
                return {
                    "status": "unreachable",
                    "error_type": type(last_error).__name__ if last_error else None,
                    "error": str(last_error or ""),
                }


class SliceSshReadyTrigger(HeldEventTrigger):
    """SshReadyTrigger's logins on several hosts at once (`hosts`: each one's SshReadyTrigger
    arguments, plain values), until every host takes the login or one needs the worker.

    Event: {"ready": [vm_name, ...], "host_keys": {vm_name: keys}, "events": {vm_name:
    SshReadyTrigger's event}}: the hosts whose login worked and the keys pinned for each, and the
    event of the host that needs the worker (empty when every host is ready). When that is the
    bound (`unreachable`), every host still waiting reaches it too: each one's event is there, for
    the worker to name every host's last error. The logins of the hosts
    still waiting are cancelled (their connections closed) when the event leaves.
    """

    def __init__(self, *, hosts: list[dict[str, Any]], first_event_after: float = 0):
        super().__init__()
        self.hosts = [dict(host) for host in hosts]
        self.first_event_after = float(first_event_after)

    def _kwargs(self) -> dict[str, Any]:
        return {"hosts": self.hosts, "first_event_after": self.first_event_after}

    async def _watch(self) -> dict[str, Any]:
        watches = {asyncio.ensure_future(SshReadyTrigger(**host)._watch()): host["vm_name"] for host in self.hosts}
        ready, pinned, events, pending = [], {}, {}, set(watches)

        def take(done) -> None:
            for watch in done:
                payload = watch.result()
                if payload["status"] == "ready":
                    ready.append(watches[watch])
                    pinned[watches[watch]] = payload["host_keys"]
                else:
                    events[watches[watch]] = payload

        try:
            while pending and not events:
                done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                take(done)
            if pending and all(event["status"] == "unreachable" for event in events.values()):
                done, pending = await asyncio.wait(pending)  # the same bound: each host's last error
                take(done)
        finally:
            await cancel_all(watches)
        return {"ready": sorted(ready), "host_keys": pinned, "events": events}
