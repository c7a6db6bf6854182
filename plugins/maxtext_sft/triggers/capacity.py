"""Wait, on the triggerer, until a reservation has a machine free.

Events (one, then the trigger ends):
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
from maxtext_sft.cloud_errors import Action, classify
from maxtext_sft.hooks.compute import ComputeEngineEndpointHook

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
