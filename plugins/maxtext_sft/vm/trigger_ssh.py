"""What the triggers that SSH to a run's VM share (vm/training_watch.py, vm/ssh_ready.py): where
the VM is and how to log in (vm/ssh_async.py: only the host keys it published are accepted; with
OS Login, the key renewed before a login once half its lifetime passed: cloud/os_login.py),
their poll's pace and deadline, the Compute API's word on a VM that does not answer, and the hold
of their one event.

An event does not leave before `first_event_after` seconds from the trigger's start: Airflow 3.3
fails a resumed try that is already running when the executor's report of the deferral arrives
(apache/airflow#72716), so the event waits that report out (the polls and their log lines do not).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

from airflow.triggers.base import BaseTrigger, TriggerEvent


class HeldEventTrigger(BaseTrigger):
    """One event, `_watch`'s payload, sent no sooner than `first_event_after` seconds from the start."""

    first_event_after: float = 0

    async def run(self) -> AsyncIterator[TriggerEvent]:
        started = time.monotonic()
        payload = await self._watch()
        await asyncio.sleep(max(0.0, started + self.first_event_after - time.monotonic()))
        yield TriggerEvent(payload)

    async def _watch(self) -> dict[str, Any]:
        """Poll until something needs the worker: the event's payload."""
        raise NotImplementedError

    def serialize(self) -> tuple[str, dict[str, Any]]:
        return f"{type(self).__module__}.{type(self).__qualname__}", self._kwargs()

    def _kwargs(self) -> dict[str, Any]:
        """The constructor's arguments, as plain JSON values."""
        raise NotImplementedError


def vm_ssh_kwargs(
    spec, target: dict[str, Any], *, ssh_conn_id: str, gcp_conn_id: str, poll_interval: float, first_event_after: float
) -> dict[str, Any]:
    """A VmSshTrigger's arguments for `spec`'s VM (a RunSpec): `target` (vm.access.ssh_target's host,
    host_keys: the only ones accepted; username, os_login, iap), its connections, its pace."""
    return {
        "ssh_conn_id": ssh_conn_id,
        **target,
        "vm_name": spec.vm_name,
        "project_id": spec.project_id,
        "zone": spec.zone,
        "gcp_conn_id": gcp_conn_id,
        "poll_interval": poll_interval,
        "connect_timeout": spec.ssh_connect_timeout_seconds,
        "first_event_after": first_event_after,
    }


async def cancel_all(watches) -> None:
    """Cancel the watches still under way and wait for them to end (their connections closed)."""
    for watch in watches:
        watch.cancel()
    await asyncio.gather(*watches, return_exceptions=True)


class VmSshTrigger(HeldEventTrigger):
    """Poll the VM every `poll_interval` (the first after `first_poll_after`) until `_watch` returns
    the payload of the one event."""

    def __init__(
        self,
        *,
        ssh_conn_id: str,
        host: str,
        host_keys: dict[str, str],
        vm_name: str,
        project_id: str,
        zone: str,
        gcp_conn_id: str,
        poll_interval: float,
        deadline: float,
        username: str | None = None,
        os_login: dict[str, Any] | None = None,
        iap: dict[str, Any] | None = None,
        connect_timeout: float = 30,
        command_timeout: float = 120,
        first_poll_after: float | None = None,
        first_event_after: float = 0,
    ):
        super().__init__()
        self.ssh_conn_id = ssh_conn_id
        self.host = host
        self.host_keys = dict(host_keys)
        self.vm_name = vm_name
        self.project_id = project_id
        self.zone = zone
        self.gcp_conn_id = gcp_conn_id
        self.poll_interval = float(poll_interval)
        self.deadline = float(deadline)
        self.username = username
        self.os_login = dict(os_login) if os_login else None  # the imported key's renewal (cloud/os_login.py)
        self.iap = dict(iap) if iap else None  # the IAP tunnel's target (cloud/iap_tunnel.py), no secret
        self.connect_timeout = float(connect_timeout)
        self.command_timeout = float(command_timeout)
        self.first_poll_after = self.poll_interval if first_poll_after is None else float(first_poll_after)
        self.first_event_after = float(first_event_after)

    def _kwargs(self) -> dict[str, Any]:
        """The constructor's arguments, as plain JSON values (a subclass adds its own)."""
        return {
            "ssh_conn_id": self.ssh_conn_id,
            "host": self.host,
            "host_keys": self.host_keys,
            "vm_name": self.vm_name,
            "project_id": self.project_id,
            "zone": self.zone,
            "gcp_conn_id": self.gcp_conn_id,
            "poll_interval": self.poll_interval,
            "deadline": self.deadline,
            "username": self.username,
            "os_login": self.os_login,
            "iap": self.iap,
            "connect_timeout": self.connect_timeout,
            "command_timeout": self.command_timeout,
            "first_poll_after": self.first_poll_after,
            "first_event_after": self.first_event_after,
        }

    def _hook(self, host_keys: dict[str, str] | None = None):
        """An asyncssh hook to the VM that accepts only `host_keys` (default: the given ones)."""
        from maxtext_sft.vm.ssh_async import VmSSHHookAsync

        return VmSSHHookAsync(
            ssh_conn_id=self.ssh_conn_id,
            host=self.host,
            host_keys=self.host_keys if host_keys is None else host_keys,
            username=self.username,
            connect_timeout=self.connect_timeout,
            iap=self.iap,
        )

    async def _renew_os_login_key(self) -> None:
        """With OS Login, before a login: import the key again once half its lifetime passed (the
        VM takes only an unexpired key). A failed renewal is logged: the login may still work, and
        a refused one is reported as any refusal."""
        if not self.os_login:
            return
        from maxtext_sft.cloud.os_login import renew_key, renewal_due

        if not renewal_due(self.os_login):
            return
        try:
            self.os_login = await asyncio.to_thread(renew_key, self.gcp_conn_id, self.os_login, caller="triggerer")
        except Exception as error:  # noqa: BLE001 - the login that follows tells whether it mattered
            self.log.warning("Could not renew the OS Login key of %s: %s: %s", self.username, type(error).__name__, error)
            return
        self.log.info("OS Login key of %s renewed until %s", self.username,
                      time.strftime("%H:%M:%S", time.gmtime(self.os_login["expires_at"])))

    async def _vm_lost(self) -> bool:
        """Whether the Compute API says the unanswering VM is gone or stopped (a read that fails
        says nothing: the bound still applies)."""
        from maxtext_sft.cloud.compute import vm_lost

        return await vm_lost(self.gcp_conn_id, self.vm_name, self.project_id, self.zone, self.log)
