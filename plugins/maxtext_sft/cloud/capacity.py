"""Wait, on the triggerer, for a machine in a reservation, or through a zone's stockout.

ReservationCapacityTrigger waits until a reservation has a machine free; StockoutWaitTrigger
pauses before an insert refused for a stockout is asked again (a run with no reservation);
QueuedInsertTrigger waits for a flex-start VM's queued request to get its machine;
CreateVmStartTrigger (below) is create_vm's whole wait, started by the scheduler, which inserts
the VM itself.

ReservationCapacityTrigger's events (one, then the trigger ends):
  {"status": "free", "free": N, "count": C, "checked_at": T, "deadline": D}
  {"status": "timeout", "count": C, "in_use": U, "deadline": D}   nothing freed up before D
  {"status": "error", "message": ..., "deadline": D}              e.g. the reservation is gone
Every event carries the deadline, so the operator it resumes needs nothing else to go on waiting.
A read that fails for a passing reason (HTTP 429 or 5xx, after the client's own retries; a
connection error) does not end the wait: the next poll reads again. Such failures until the
deadline end it as a timeout when some read succeeded, else as an error naming the last failure.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Sequence
from datetime import datetime
from typing import Any

from airflow.triggers.base import BaseTrigger, TriggerEvent
from google.api_core.exceptions import NotFound

from maxtext_sft.cloud.errors import Action, classify
from maxtext_sft.cloud.compute import ComputeEngineEndpointHook
from maxtext_sft.cloud.instances import insert_request_id, with_expiry_label
from maxtext_sft.cloud.trigger_start import from_json

# When a task waiting for capacity has the trigger read a full reservation: first after the
# deferral, then every poll (CreateVmOperator says why the first is longer).
CAPACITY_FIRST_READ_SECONDS = 60
CAPACITY_POLL_SECONDS = 15


def passing_failure(error: Exception) -> bool:
    """A failure worth reading again for: what the error table retries (throttling, a server
    error), or the network."""
    if isinstance(error, OSError):  # connection refused or reset, a socket timeout
        return True
    verdict = classify(error)
    return verdict is not None and verdict.action is Action.RETRY


def epoch_seconds(moment: float | int | str | datetime) -> float:
    """A deadline given as epoch seconds, an ISO 8601 string or an aware datetime, as epoch seconds."""
    if isinstance(moment, str):
        moment = datetime.fromisoformat(moment)
    if isinstance(moment, datetime):
        if moment.tzinfo is None:
            raise ValueError(f"deadline {moment.isoformat()} has no time zone")
        return moment.timestamp()
    return float(moment)


class ReservationCapacityTrigger(BaseTrigger):
    """Poll reservations.get until `count - inUseCount >= needed` (1, or a slice's hosts), or until `deadline`.

    It is deferred to right after someone found the reservation full (the operator's own read,
    or the cloud refusing an insert), so its first read waits `first_read_after` (default
    `poll_interval`), the later ones `poll_interval`: an immediate re-read would only say "full"
    again, or, if the reservation's count lags behind the insert that was refused, send the
    operator back to an insert that is refused again without pause; and an event fired before
    the executor reported the deferral fails the resumed try (apache/airflow#72716).
    """

    def __init__(
        self,
        project_id: str,
        zone: str,
        reservation: str,
        deadline: float | int | str | datetime,
        gcp_conn_id: str = "google_cloud_default",
        poll_interval: float = 60,
        impersonation_chain: str | Sequence[str] | None = None,
        first_read_after: float | None = None,
        needed: int = 1,
    ):
        super().__init__()
        self.needed = int(needed)  # machines that must be free at once: a slice's every host
        self.project_id = project_id
        self.zone = zone
        self.reservation = reservation
        self.deadline = epoch_seconds(deadline)
        self.gcp_conn_id = gcp_conn_id
        self.poll_interval = float(poll_interval)
        self.first_read_after = self.poll_interval if first_read_after is None else float(first_read_after)
        self.impersonation_chain = impersonation_chain
        self._hook: ComputeEngineEndpointHook | None = None

    @classmethod
    def for_operator(cls, operator, deadline: float, needed: int = 1) -> ReservationCapacityTrigger:
        """The trigger a create operator defers to: its reservation, connection and read timings
        (capacity_poll_seconds, capacity_first_read_seconds)."""
        return cls(
            project_id=operator.project_id,
            zone=operator.zone,
            reservation=operator.reservation,
            deadline=deadline,
            gcp_conn_id=operator.gcp_conn_id,
            poll_interval=operator.capacity_poll_seconds,
            first_read_after=operator.capacity_first_read_seconds,
            impersonation_chain=operator.impersonation_chain,
            needed=needed,
        )

    def serialize(self) -> tuple[str, dict[str, Any]]:
        return (
            f"{type(self).__module__}.{type(self).__qualname__}",
            {
                "project_id": self.project_id,
                "zone": self.zone,
                "reservation": self.reservation,
                "deadline": self.deadline,
                "gcp_conn_id": self.gcp_conn_id,
                "poll_interval": self.poll_interval,
                "impersonation_chain": self.impersonation_chain,
                "first_read_after": self.first_read_after,
                "needed": self.needed,
            },
        )

    def _read(self) -> tuple[int, int] | None:
        """(count, inUseCount); blocking (the Google clients are synchronous), so run in a thread."""
        if self._hook is None:
            self._hook = ComputeEngineEndpointHook(
                gcp_conn_id=self.gcp_conn_id, impersonation_chain=self.impersonation_chain
            )
        return self._hook.reservation_capacity(name=self.reservation, zone=self.zone, project_id=self.project_id)

    async def run(self) -> AsyncIterator[TriggerEvent]:
        where = f"reservation {self.reservation} in {self.project_id}/{self.zone}"
        last_read: tuple[int, int] | None = None  # (count, inUseCount) of the last read that worked
        pause = self.first_read_after
        while True:
            # Read at least once, and last at the deadline.
            await asyncio.sleep(max(0.0, min(pause, self.deadline - time.time())))
            pause = self.poll_interval
            try:
                capacity = await asyncio.to_thread(self._read)
            except Exception as error:  # noqa: BLE001 - reported to the operator, which fails the try
                failure = f"reading {where}: {error}"
                if not passing_failure(error):
                    yield TriggerEvent({"status": "error", "message": failure, "deadline": self.deadline})
                    return
                self.log.warning("%s; reading again in %.0f s", failure, self.poll_interval)
            else:
                if capacity is None:
                    yield TriggerEvent({"status": "error", "message": f"{where} does not exist", "deadline": self.deadline})
                    return
                count, in_use = last_read = capacity
                if count - in_use >= self.needed:
                    yield TriggerEvent(
                        {
                            "status": "free",
                            "free": count - in_use,
                            "count": count,
                            "checked_at": time.time(),
                            "deadline": self.deadline,
                        }
                    )
                    return
                self.log.info("%s: %d of %d machines in use; waiting for %d to be free", where, in_use, count, self.needed)
            if time.time() >= self.deadline:
                if last_read is None:  # not one read worked: the last failure is the news
                    yield TriggerEvent({"status": "error", "message": failure, "deadline": self.deadline})
                else:
                    count, in_use = last_read
                    yield TriggerEvent({"status": "timeout", "count": count, "in_use": in_use, "deadline": self.deadline})
                return


def stockout_pause(poll_seconds: float, first_read_seconds: float) -> float:
    """How long a task deferred through a stockout waits before asking again: the poll, but no
    less than the first read after any deferral a worker made, which waits out the executor's
    report of it (apache/airflow#72716)."""
    return max(float(poll_seconds), float(first_read_seconds))


class StockoutWaitTrigger(BaseTrigger):
    """Wait `wait_seconds` (or until `deadline`, if sooner) before an insert the zone refused for
    lack of capacity is asked again: a run with no reservation has nothing to read that says
    when a machine frees, so the wait is a pause on the triggerer, holding no worker slot.

    Its one event has the reservation trigger's shape, so the same resume methods take it:
      {"status": "free", "free": None, "count": None, "checked_at": T, "deadline": D}   ask again
      {"status": "timeout", "count": None, "in_use": None, "deadline": D}              D has passed
    """

    def __init__(self, deadline: float | int | str | datetime, wait_seconds: float = CAPACITY_POLL_SECONDS):
        super().__init__()
        self.deadline = epoch_seconds(deadline)
        self.wait_seconds = float(wait_seconds)

    def serialize(self) -> tuple[str, dict[str, Any]]:
        return (
            f"{type(self).__module__}.{type(self).__qualname__}",
            {"deadline": self.deadline, "wait_seconds": self.wait_seconds},
        )

    async def run(self) -> AsyncIterator[TriggerEvent]:
        await asyncio.sleep(max(0.0, min(self.wait_seconds, self.deadline - time.time())))
        if time.time() >= self.deadline:
            yield TriggerEvent({"status": "timeout", "count": None, "in_use": None, "deadline": self.deadline})
            return
        event = {"status": "free", "free": None, "count": None, "checked_at": time.time(), "deadline": self.deadline}
        yield TriggerEvent(event)


class QueuedInsertTrigger(BaseTrigger):
    """Wait for a flex-start VM's queued request: the instance is PENDING (no machine, nothing
    billed: the discovery document's Instance.status) until Compute Engine has a machine, then
    PROVISIONING, STAGING, RUNNING; or the request expires at its requestValidForDuration and the
    instance is deleted, its insert operation ending with an error. Polls instances.get every
    `poll_interval` (and the insert's `operation`, when known, once the instance is gone).

    Events (one, then the trigger ends):
      {"status": "running", "queued_seconds": S}                        the VM is RUNNING
      {"status": "ended", "instance_status": X, "operation": {...}|None, "queued_seconds": S}
                                                                        no machine came: the request ended
      {"status": "timeout", "queued_seconds": S}                        still PENDING at `deadline`
    A read that fails for a passing reason is read again at the next poll.

    The first read waits `first_read_after` (default `poll_interval`): a machine that comes at
    once would otherwise fire the event before the executor reported the deferral, and the
    scheduler fails a try that resumes that early (apache/airflow#72716), as for
    ReservationCapacityTrigger.
    """

    def __init__(
        self,
        project_id: str,
        zone: str,
        resource_id: str,
        deadline: float | int | str | datetime,
        operation: str | None = None,
        gcp_conn_id: str = "google_cloud_default",
        poll_interval: float = CAPACITY_POLL_SECONDS,
        impersonation_chain: str | Sequence[str] | None = None,
        queued_since: float | None = None,
        first_read_after: float | None = None,
    ):
        super().__init__()
        self.project_id = project_id
        self.zone = zone
        self.resource_id = resource_id
        self.deadline = epoch_seconds(deadline)
        self.operation = operation
        self.gcp_conn_id = gcp_conn_id
        self.poll_interval = float(poll_interval)
        self.impersonation_chain = impersonation_chain
        self.queued_since = time.time() if queued_since is None else float(queued_since)
        self.first_read_after = self.poll_interval if first_read_after is None else float(first_read_after)

    def serialize(self) -> tuple[str, dict[str, Any]]:
        return (
            f"{type(self).__module__}.{type(self).__qualname__}",
            {
                "project_id": self.project_id,
                "zone": self.zone,
                "resource_id": self.resource_id,
                "deadline": self.deadline,
                "operation": self.operation,
                "gcp_conn_id": self.gcp_conn_id,
                "poll_interval": self.poll_interval,
                "impersonation_chain": self.impersonation_chain,
                "queued_since": self.queued_since,
                "first_read_after": self.first_read_after,
            },
        )

    def _hook(self) -> ComputeEngineEndpointHook:
        return ComputeEngineEndpointHook(gcp_conn_id=self.gcp_conn_id, impersonation_chain=self.impersonation_chain)

    def _read(self) -> tuple[str | None, dict | None]:
        """(the instance's status, the insert operation once DONE or gone, else None)."""
        hook = self._hook()
        where = {"zone": self.zone, "project_id": self.project_id}
        status = hook.instance_status(self.resource_id, **where)
        if status in ("PENDING", "PROVISIONING", "STAGING", "RUNNING") or self.operation is None:
            return status, None
        operation = hook.get_zone_operation(self.operation, **where)
        return status, operation if operation is None or operation.get("status") == "DONE" else {"status": "RUNNING"}

    async def run(self) -> AsyncIterator[TriggerEvent]:
        last = None
        await asyncio.sleep(max(0.0, min(self.first_read_after, self.deadline - time.time())))
        while True:
            queued = round(time.time() - self.queued_since, 1)
            try:
                status, operation = await asyncio.to_thread(self._read)
            except Exception as error:  # noqa: BLE001 - a passing failure is read again; others end the wait
                if not passing_failure(error):
                    raise
                self.log.warning("Reading the queued VM %s: %s; reading again", self.resource_id, error)
            else:
                if status != last:
                    self.log.info("VM %s is %s after %.0f s in the flex-start queue", self.resource_id, status, queued)
                    last = status
                if status == "RUNNING":
                    yield TriggerEvent({"status": "running", "queued_seconds": queued})
                    return
                if status not in ("PENDING", "PROVISIONING", "STAGING") and (operation or {}).get("status") != "RUNNING":
                    yield TriggerEvent(
                        {"status": "ended", "instance_status": status, "operation": operation, "queued_seconds": queued}
                    )
                    return
            if time.time() >= self.deadline:
                yield TriggerEvent({"status": "timeout", "queued_seconds": queued})
                return
            await asyncio.sleep(max(0.0, min(self.poll_interval, self.deadline - time.time())))


class CreateVmStartTrigger(BaseTrigger):
    """create_vm's try, started on the triggerer by the scheduler (start_from_trigger): no worker
    runs before it, none while the reservation is full. It inserts the VM itself as soon as a
    machine is free, so a run that waited for capacity takes no worker slot for the wait.

    Its fields are templates of plan_run's XCom (cloud/trigger_start.py), rendered by the triggerer as
    JSON text: project_id, zone, resource_id, request_id, body, lifetime_minutes, reservation,
    max_capacity_wait_minutes (the deadline counts from this trigger's start). Each poll, in order:
    - the instance exists (any status): {"status": "go"}, the worker adopts or replaces it;
    - no reservation, or it does not exist: {"status": "go"}, the worker creates or fails naming it;
    - the reservation is full: poll again in `poll_interval` seconds;
    - a machine is free: insert, with the expiry label counted from now, the provider's body
      sanitizer and a request id of its own per insert; done: {"status": "created"} (the worker
      adopts it); refused for capacity (cloud.errors, e.g. a race with another run): poll again;
      any other failure of the insert: {"status": "go"}, the worker inserts again and judges it
      by its own rules (a stockout or a 5xx to the task's retries, a refusal for good fails).
    A read that fails for a passing reason (passing_failure) is polled again. At the
    deadline with the reservation still full: {"status": "timeout", "count": C}; when not one read
    worked by then, "go" (the worker's own read names the failure). Every event carries the deadline.
    """

    def __init__(
        self,
        *,
        project_id: str,
        zone: str,
        resource_id: str | None,
        request_id: str | None,
        body: str | dict,
        lifetime_minutes: str | int | None,
        reservation: str | None,
        max_capacity_wait_minutes: str | float,
        gcp_conn_id: str = "google_cloud_default",
        api_version: str = "v1",
        impersonation_chain: str | Sequence[str] | None = None,
        poll_interval: float = CAPACITY_POLL_SECONDS,
    ):
        super().__init__()
        self.project_id = project_id
        self.zone = zone
        self.resource_id = resource_id
        self.request_id = request_id
        self.body = body
        self.lifetime_minutes = lifetime_minutes
        self.reservation = reservation
        self.max_capacity_wait_minutes = max_capacity_wait_minutes
        self.gcp_conn_id = gcp_conn_id
        self.api_version = api_version
        self.impersonation_chain = impersonation_chain
        self.poll_interval = float(poll_interval)

    RENDERED = (
        "project_id", "zone", "resource_id", "request_id", "body", "lifetime_minutes", "reservation",
        "max_capacity_wait_minutes",
    )

    def serialize(self) -> tuple[str, dict[str, Any]]:
        return (
            f"{type(self).__module__}.{type(self).__qualname__}",
            {
                **{name: getattr(self, name) for name in self.RENDERED},
                "gcp_conn_id": self.gcp_conn_id,
                "api_version": self.api_version,
                "impersonation_chain": self.impersonation_chain,
                "poll_interval": self.poll_interval,
            },
        )

    def _values(self) -> dict[str, Any]:
        """The rendered fields' values (each JSON text; a value that is not text is itself)."""
        values = {name: from_json(getattr(self, name)) for name in self.RENDERED}
        values["resource_id"] = (values["body"] or {}).get("name") or values["resource_id"]
        return values

    def _try_number(self) -> int:
        return int(getattr(self.task_instance, "try_number", 0) or 0)

    async def run(self) -> AsyncIterator[TriggerEvent]:
        run = self._values()
        deadline = time.time() + float(run["max_capacity_wait_minutes"]) * 60
        hook = ComputeEngineEndpointHook(
            gcp_conn_id=self.gcp_conn_id, api_version=self.api_version, impersonation_chain=self.impersonation_chain
        )
        last_count: int | None = None
        reported: tuple[int, int] | None = None
        while True:
            try:
                outcome = await asyncio.to_thread(self._attempt, hook, run)
            except Exception as error:  # noqa: BLE001 - judged below: wait again, or the worker's
                if not passing_failure(error):
                    self.log.warning("Creating %s: %s; the worker goes on", run["resource_id"], error)
                    yield TriggerEvent({"status": "go", "reason": str(error), "deadline": deadline})
                    return
                self.log.warning("Creating %s: %s; trying again in %.0f s", run["resource_id"], error, self.poll_interval)
            else:
                if isinstance(outcome, dict):
                    yield TriggerEvent({**outcome, "deadline": deadline})
                    return
                last_count, in_use, refusal = outcome
                if refusal:
                    self.log.warning("The cloud refused the insert for lack of capacity: %s; waiting", refusal)
                elif reported != (last_count, in_use):
                    self.log.info(
                        "Reservation %s: %d of %d machines in use; waiting (deferred, no worker slot) until %s",
                        run["reservation"], in_use, last_count, time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(deadline)),
                    )
                reported = (last_count, in_use)
            if time.time() >= deadline:
                status = {"status": "timeout", "count": last_count} if last_count is not None else {"status": "go"}
                yield TriggerEvent({**status, "deadline": deadline})
                return
            await asyncio.sleep(max(0.0, min(self.poll_interval, deadline - time.time())))

    def _attempt(self, hook: ComputeEngineEndpointHook, run: dict[str, Any]) -> dict[str, Any] | tuple[int, int, str | None]:
        """One poll; blocking (the Google clients are synchronous), so run in a thread. The event
        to send, or (count, in use, the cloud's refusal of an insert) to wait on."""
        name, reservation = run["resource_id"], run["reservation"]
        where = {"project_id": run["project_id"], "zone": run["zone"]}
        try:
            existing = hook.get_instance(resource_id=name, **where)
        except NotFound:
            pass
        else:
            return {"status": "go", "reason": f"instance {name} exists ({existing.status})"}
        if not reservation:
            return {"status": "go", "reason": "no reservation to wait for"}
        capacity = hook.reservation_capacity(name=reservation, **where)
        if capacity is None:
            return {"status": "go", "reason": f"reservation {reservation} does not exist"}
        count, in_use = capacity
        if in_use >= count:
            return count, in_use, None
        body = dict(run["body"])
        if run["lifetime_minutes"]:
            body = with_expiry_label(body, int(run["lifetime_minutes"]))
        # Imported here: the provider's operators module is heavy, and only this step needs it.
        from airflow.providers.google.cloud.operators.compute import GCE_INSTANCE_FIELDS_TO_SANITIZE
        from airflow.providers.google.cloud.utils.field_sanitizer import GcpBodyFieldSanitizer

        GcpBodyFieldSanitizer(GCE_INSTANCE_FIELDS_TO_SANITIZE).sanitize(body)
        request_id = run["request_id"] and insert_request_id(run["request_id"], self._try_number(), f"/start/{time.time()}")
        self.log.info("Reservation %s has %d of %d machines free: creating %s", reservation, count - in_use, count, name)
        try:
            hook.insert_instance(body=body, request_id=request_id, **where)
        except Exception as error:  # noqa: BLE001 - judged here, or by the worker
            verdict = classify(error)
            if verdict is not None and verdict.action is Action.WAIT_FOR_CAPACITY:
                return count, in_use, str(verdict)
            # Anything else keeps the worker's rules: a stockout or a 5xx its retries with backoff,
            # a refusal for good its failure naming the cause (it inserts again and judges).
            return {"status": "go", "reason": f"the insert of {name} failed: {verdict or error}"}
        self.log.info("Instance %s is created", name)
        return {"status": "created"}
