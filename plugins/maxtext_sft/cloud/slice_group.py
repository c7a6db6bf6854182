"""Wait, on the triggerer, until every host of a slice's managed instance group is RUNNING.

Events (one, then the trigger ends):
  {"status": "ready", "hosts": [{"name", "ip", "id"}, ...]}   in worker order (by name)
  {"status": "failed", "message": ...}    a host's creation failed for a cause that waiting cannot
                                          change, or the group is gone
  {"status": "timeout", "message": ...}   not every host RUNNING by the deadline
A MIG keeps retrying a host it could not create, and reports each attempt's errors in the
managed instance's `lastAttempt.errors` (the same {code, message} errors an instance insert's
operation has): they are classified by `cloud.errors`. Any refusal but a passing one (throttling,
a server error) fails the wait at once, capacity included: the hosts already up are paid for
while a missing one waits, so capacity is waited for before the group is created, not here.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

from airflow.triggers.base import BaseTrigger, TriggerEvent
from maxtext_sft.cloud.errors import Action, classify_items
from maxtext_sft.cloud.compute import ComputeEngineEndpointHook
from maxtext_sft.cloud.capacity import passing_failure


def hosts_state(members: list[dict], hosts: int) -> tuple[str, Any]:
    """What a group's managed instances (listManagedInstances, REST JSON) say: ("ready", names in
    worker order), ("failed", why), or ("waiting", what is not ready yet)."""
    for member in members:
        errors = ((member.get("lastAttempt") or {}).get("errors") or {}).get("errors") or []
        verdict = classify_items(errors)
        if errors and (verdict is None or verdict.action is not Action.RETRY):
            name = member.get("instance", "").rsplit("/", 1)[-1] or member.get("name", "?")
            cause = str(verdict) if verdict else "; ".join(f"{e.get('code')}: {e.get('message')}" for e in errors)
            return "failed", f"Compute Engine could not create host {name}: {cause}"
    running = sorted(
        m["instance"].rsplit("/", 1)[-1]
        for m in members
        if m.get("instanceStatus") == "RUNNING" and m.get("currentAction") == "NONE" and m.get("instance")
    )
    if len(running) >= hosts:
        return "ready", running[:hosts]
    return "waiting", f"{len(running)} of {hosts} hosts RUNNING"


class SliceHostsTrigger(BaseTrigger):
    """Poll the group's managed instances until `hosts` of them are RUNNING, then read each one's
    internal address (what the hosts know each other by: the JAX coordinator, TPU_WORKER_HOSTNAMES)."""

    def __init__(
        self,
        *,
        project_id: str,
        zone: str,
        group: str,
        hosts: int,
        deadline: float,
        gcp_conn_id: str,
        poll_interval: float = 10,
        impersonation_chain: Any = None,
    ):
        super().__init__()
        self.project_id = project_id
        self.zone = zone
        self.group = group
        self.hosts = hosts
        self.deadline = deadline
        self.gcp_conn_id = gcp_conn_id
        self.poll_interval = poll_interval
        self.impersonation_chain = impersonation_chain

    def serialize(self) -> tuple[str, dict[str, Any]]:
        return (
            f"{type(self).__module__}.{type(self).__qualname__}",
            {
                "project_id": self.project_id,
                "zone": self.zone,
                "group": self.group,
                "hosts": self.hosts,
                "deadline": self.deadline,
                "gcp_conn_id": self.gcp_conn_id,
                "poll_interval": self.poll_interval,
                "impersonation_chain": self.impersonation_chain,
            },
        )

    def _hook(self) -> ComputeEngineEndpointHook:
        return ComputeEngineEndpointHook(gcp_conn_id=self.gcp_conn_id, impersonation_chain=self.impersonation_chain)

    def _read(self) -> tuple[str, Any]:
        hook = self._hook()
        members = hook.list_managed_instances(group=self.group, zone=self.zone, project_id=self.project_id)
        if members is None:
            return "failed", f"instance group {self.group} in {self.project_id}/{self.zone} does not exist"
        state, value = hosts_state(members, self.hosts)
        if state != "ready":
            return state, value
        hosts = []
        for name in value:
            instance = hook.get_instance_info(zone=self.zone, resource_id=name, project_id=self.project_id)
            hosts.append({"name": name, "ip": instance["networkInterfaces"][0]["networkIP"], "id": instance["id"]})
        return "ready", hosts

    async def run(self) -> AsyncIterator[TriggerEvent]:
        where = f"instance group {self.group} in {self.project_id}/{self.zone}"
        last = "not read yet"
        while True:
            try:
                state, value = await asyncio.to_thread(self._read)
            except Exception as error:  # noqa: BLE001 - reported to the operator, which fails the try
                if not passing_failure(error):
                    yield TriggerEvent({"status": "failed", "message": f"reading {where}: {error}"})
                    return
                state, value = "waiting", f"reading {where}: {error}"
            if state == "ready":
                yield TriggerEvent({"status": "ready", "hosts": value})
                return
            if state == "failed":
                yield TriggerEvent({"status": "failed", "message": value})
                return
            last = value
            self.log.info("%s: %s", where, last)
            if time.time() >= self.deadline:
                yield TriggerEvent({"status": "timeout", "message": f"{where}: {last}"})
                return
            await asyncio.sleep(max(0.0, min(self.poll_interval, self.deadline - time.time())))
