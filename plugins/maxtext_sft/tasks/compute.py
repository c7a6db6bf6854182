"""The provider's Compute Engine insert, stop and delete operators, on the endpoint-aware hook, and
the image of a stopped VM's disk (the provider has no image operator).

Each `execute` keeps the provider's flow; what changes is the hook (so the connection can name a
private API endpoint), for create a capacity gate in front of the insert (see CreateVmOperator),
and for delete the outcome the teardown needs: an instance that is already gone is success, and
success means it is really gone.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import NoReturn

from google.api_core.exceptions import NotFound
from google.cloud.compute_v1.types import Instance

from airflow.providers.google.cloud.operators.compute import (
    ComputeEngineDeleteInstanceOperator,
    ComputeEngineInsertInstanceOperator,
    ComputeEngineStopInstanceOperator,
)
from airflow.sdk import BaseOperator
from airflow.sdk.exceptions import AirflowException, AirflowFailException
from airflow.triggers.base import StartTriggerArgs
from maxtext_sft.cloud.errors import Action, OperationFailed, classify, waits_for_capacity
from maxtext_sft.cloud.compute import ComputeEngineEndpointHook, endpoint_hook_for
from maxtext_sft.cloud.instances import adoptable_instance, insert_request_id, insert_with_fallback, with_expiry_label
from maxtext_sft.results.summary import REFUSED_FIELDS_KEY
from maxtext_sft.ui.task_links import VmConsoleLink
from maxtext_sft.cloud.trigger_start import xcom_arg_template
from maxtext_sft.cloud.capacity import (
    CAPACITY_FIRST_READ_SECONDS,
    CAPACITY_POLL_SECONDS,
    CreateVmStartTrigger,
    QueuedInsertTrigger,
    ReservationCapacityTrigger,
    StockoutWaitTrigger,
    stockout_pause,
)

# How long past a flex-start request's validity its wait goes on before the task gives up on the
# cloud ending it (it deletes the instance at the validity's end).
QUEUE_MARGIN_MINUTES = 10


class CreateVmOperator(ComputeEngineInsertInstanceOperator):
    """Create the instance unless it exists: a retry adopts the VM this run already asked for.

    An instance left by a create that failed after the API accepted it (TERMINATED, say) is not
    adopted: it is deleted and created again. The insert's request id is made per try: the API
    answers a repeated request id with the first request's operation, failed ones included.

    Every failed insert, refused at once or on its operation, is classified by
    `maxtext_sft.cloud.errors` (one table): a full reservation goes to the capacity gate, a
    stockout or a passing error is raised for the task's retries, and quota, permission,
    organisation policy, a missing or unusable reservation or an unsupported configuration fail
    the task at once (AirflowFailException naming the code and message): retrying cannot help.

    Capacity gate (with `reservation`): no more VMs at once than the reservation holds, across
    every DAG and person using it. Before inserting, the reservation's count minus inUseCount is
    read; with none free, or when the cloud refuses the insert for capacity (a race with another
    run), the task defers to ReservationCapacityTrigger (no worker slot) and inserts when a
    machine is free. The wait is bounded by `max_capacity_wait_minutes` from the first deferral
    (the deadline travels with every deferral, so refused inserts do not extend it); then the
    task fails without retries. An existing instance is adopted before any gate.

    Started on the triggerer: when every value the insert needs is another task's output (the
    pipeline's plan_run) and a reservation may be given, each try starts as CreateVmStartTrigger
    (start_from_trigger): it waits for a free machine and inserts the VM itself, and the worker
    only adopts it, so no worker slot is taken while the reservation is full. A try that the
    trigger hands back ("go": the instance already exists, a refusal it does not judge) takes the
    flow above. Values written into the DAG, and dag.test(), which ignores start_from_trigger,
    start on the worker.

    Without a reservation (`waits_out_stockouts`: Spot, flex-start, on demand), a zone's stockout
    is waited out the same way: deferred to StockoutWaitTrigger, the insert asked again every
    `capacity_poll_seconds` (no sooner than `capacity_first_read_seconds`: stockout_pause), up to
    `max_capacity_wait_minutes` from the first refusal.

    Flex-start (`queue_minutes`, its request's validity): the insert's operation stays RUNNING while
    the request waits in Compute Engine's queue, the instance PENDING; the task inserts without
    waiting and defers to QueuedInsertTrigger until the VM is RUNNING, or fails naming the
    request's expiry (nothing billed; delete_vm removes what is left). A retry that finds the
    instance still PENDING waits for the same request.

    The trigger first reads the reservation (or the queued VM) `capacity_first_read_seconds` after
    the deferral, then every `capacity_poll_seconds`. Keep the first well above the time the
    executor takes to report a deferred try's exit: Airflow 3.3 fails a resumed try that is already
    running when that report arrives (apache/airflow#72716; the retry then adopts the VM). The later
    reads only decide how long a freed machine stays idle (a backfill's runs wait for each other's
    machines).
    """

    template_fields: Sequence[str] = (
        *ComputeEngineInsertInstanceOperator.template_fields,
        "lifetime_minutes",
        "reservation",
        "waits_out_stockouts",
        "queue_minutes",
        "max_capacity_wait_minutes",
    )
    # Instead of the provider's instance link, which reads parse-time fields: the VM this try
    # created or adopted, from its return value.
    operator_extra_links = (VmConsoleLink(),)

    def __init__(
        self,
        *,
        lifetime_minutes=None,
        reservation: str | None = None,
        waits_out_stockouts: bool | str = False,
        queue_minutes: float | str | None = None,
        max_capacity_wait_minutes: float | str = 720,
        capacity_poll_seconds: float = CAPACITY_POLL_SECONDS,
        capacity_first_read_seconds: float = CAPACITY_FIRST_READ_SECONDS,
        **kwargs,
    ):
        super().__init__(**kwargs)
        self.lifetime_minutes = lifetime_minutes
        self.reservation = reservation
        self.waits_out_stockouts = waits_out_stockouts
        self.queue_minutes = queue_minutes
        self.max_capacity_wait_minutes = max_capacity_wait_minutes
        self.capacity_poll_seconds = capacity_poll_seconds
        self.capacity_first_read_seconds = capacity_first_read_seconds
        self._start_on_the_triggerer()

    def _start_on_the_triggerer(self) -> None:
        """Start each try as CreateVmStartTrigger when every value it needs is an XComArg (sent as
        a template the triggerer renders, cloud/trigger_start.py) or None, and `reservation` is one."""
        if xcom_arg_template(self.reservation) is None:
            return  # no reservation: nothing to wait for
        rendered = {}
        for name in CreateVmStartTrigger.RENDERED:
            value = getattr(self, name)
            rendered[name] = None if value is None else xcom_arg_template(value)
            if value is not None and rendered[name] is None:
                return  # a value written into the DAG (perhaps a template of its own): the worker starts
        self.start_from_trigger = True
        self.start_trigger_args = StartTriggerArgs(
            trigger_cls=f"{CreateVmStartTrigger.__module__}.{CreateVmStartTrigger.__qualname__}",
            trigger_kwargs={
                **rendered,
                "gcp_conn_id": self.gcp_conn_id,
                "api_version": self.api_version,
                "impersonation_chain": self.impersonation_chain,
                "poll_interval": self.capacity_poll_seconds,
            },
            next_method="resume_after_start",
            next_kwargs=None,
            timeout=None,
        )

    def execute(self, context) -> dict:
        return self._create(context, deadline=None, insert_key="")

    def resume_after_start(self, context, event: dict) -> dict:
        """Back from CreateVmStartTrigger: the VM it created is adopted; a "go" takes the worker's
        flow (adopt, or gate and insert), within the same deadline."""
        if event["status"] == "timeout":
            raise AirflowFailException(self._gave_up(event["count"], event["deadline"]))
        self.log.info("Back from the triggerer: %s", {k: v for k, v in event.items() if k != "deadline"})
        return self._create(context, deadline=event["deadline"], insert_key="")

    def resume_after_capacity_wait(self, context, event: dict) -> dict:
        # The deadline travels in the trigger's event (every event carries it), the one place the
        # resumed try reads it from.
        deadline = event["deadline"]
        if event["status"] == "timeout":
            raise AirflowFailException(self._gave_up(event["count"], deadline))
        if event["status"] != "free":
            raise AirflowException(f"Waiting for capacity in reservation {self.reservation} failed: {event['message']}")
        if event["count"] is None:
            self.log.info("Asking for the VM again after the zone's stockout")
        else:
            self.log.info("Reservation %s has %d of %d machines free", self.reservation, event["free"], event["count"])
        # A new request id for each insert after a wait: the API may answer a request id it has
        # seen with that request's outcome, here a refusal. The event's read time makes it unique.
        return self._create(context, deadline=deadline, insert_key=f"/{event['checked_at']}")

    def _create(self, context, *, deadline: float | None, insert_key: str) -> dict:
        # The expiry label counts from this insert, however long the run waited for capacity.
        if self.lifetime_minutes:
            self.body = with_expiry_label(self.body, int(self.lifetime_minutes))
        if "name" in self.body:
            self.resource_id = self.body["name"]
        if self.request_id:
            try_number = context["ti"].try_number
            self.request_id = insert_request_id(self.request_id, try_number, insert_key)
        self._validate_inputs()
        self._validate_all_body_fields()
        self.check_body_fields()
        hook = endpoint_hook_for(self)
        where = {"resource_id": self.resource_id, "project_id": self.project_id, "zone": self.zone}
        if self.queue_minutes and hook.instance_status(**where) == "PENDING":
            self._wait_in_queue(operation=None)  # an earlier try's request is still queued
        existing = adoptable_instance(hook, where, self.log)
        if existing is not None:
            return Instance.to_dict(existing)
        if not self.reservation:
            return self._insert(hook, context, deadline=None, count=None)
        capacity = hook.reservation_capacity(name=self.reservation, zone=self.zone, project_id=self.project_id)
        if capacity is None:
            raise AirflowFailException(
                f"Reservation {self.reservation} does not exist in {self.project_id}/{self.zone}: no VM was created"
            )
        count, in_use = capacity
        if in_use >= count:
            self.log.info("Reservation %s: %d of %d machines in use", self.reservation, in_use, count)
            self._wait_for_capacity(deadline, count)
        return self._insert(hook, context, deadline=deadline, count=count)

    def _insert(self, hook: ComputeEngineEndpointHook, context, *, deadline: float | None, count: int | None) -> dict:
        """Insert, and act on a refusal as `cloud.errors` says. An operation that failed after
        the insert was accepted may leave an instance: the next create (after the wait, or a
        retry) deletes it first (`adoptable_instance`), and delete_vm does whatever happens."""
        try:
            return self._create_without_refused_fields(hook, context)
        except Exception as error:
            verdict = classify(error)
            if self.waits_out_stockouts is True and waits_for_capacity(verdict, waits_out_stockouts=True):
                self.log.warning("The zone has no machine for the insert: %s", verdict)
                self._wait_out_stockout(deadline, refusal=str(verdict.error))
            if verdict is None or verdict.action is Action.RETRY:
                if verdict is not None:
                    self.log.warning("Insert refused: %s; the task's retries take it", verdict)
                raise
            if verdict.action is Action.WAIT_FOR_CAPACITY and count is not None:
                self.log.warning("The cloud refused the insert for lack of capacity: %s", verdict)
                self._wait_for_capacity(deadline, count, refusal=str(verdict.error))
            raise AirflowFailException(
                f"Compute Engine refused to create {self.resource_id}: {verdict} "
                "(not retried: retrying cannot change this)"
            ) from error

    def _create_without_refused_fields(self, hook: ComputeEngineEndpointHook, context) -> dict:
        """The create, once more without a field the cloud refused that no public source says it
        accepts (cloud.instances.UNSOURCED_FIELDS); which ones, under XCom REFUSED_FIELDS_KEY for
        the run summary."""

        def create(body: dict, request_id: str | None) -> dict:
            self.body, self.request_id = body, request_id
            return self._create_instance(hook, context)

        where = {"resource_id": self.resource_id, "project_id": self.project_id, "zone": self.zone}
        created, refused = insert_with_fallback(
            create, self.body, self.request_id, self.log, before_again=lambda: adoptable_instance(hook, where, self.log)
        )
        context["ti"].xcom_push(key=REFUSED_FIELDS_KEY, value=[field.api_name for field in refused])
        return created

    def _wait_for_capacity(self, deadline: float | None, count: int, refusal: str | None = None) -> NoReturn:
        """Defer until the reservation has a machine free; fail once the deadline has passed
        (naming the cloud's `refusal` of the insert, when that sent it here)."""
        if deadline is None:
            deadline = time.time() + float(self.max_capacity_wait_minutes) * 60
        if time.time() >= deadline:
            because = f"; the cloud refused the insert: {refusal}" if refusal else ""
            raise AirflowFailException(self._gave_up(count, deadline) + because)
        self.log.info(
            "Waiting (deferred, no worker slot) for a free machine in reservation %s until %s",
            self.reservation,
            time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(deadline)),
        )
        self.defer(
            trigger=ReservationCapacityTrigger.for_operator(self, deadline), method_name="resume_after_capacity_wait"
        )

    def _create_instance(self, hook: ComputeEngineEndpointHook, context) -> dict:
        """The provider's create, but for a flex-start request: inserted without waiting for its
        operation, which lasts as long as the request is queued."""
        if not self.queue_minutes:
            return super()._create_instance(hook, context)
        # (The provider's sanitizer drops output-only fields, of which the planned body has none.)
        operation = hook.start_insert_instance(
            body=self.body, zone=self.zone, project_id=self.project_id, request_id=self.request_id
        )
        self._wait_in_queue(operation)

    def _wait_in_queue(self, operation: str | None) -> NoReturn:
        minutes = float(self.queue_minutes)
        self.log.info(
            "Flex-start request for %s queued: waiting (deferred, no worker slot, nothing billed) for a machine, "
            "at most %g minutes", self.resource_id, minutes,
        )
        trigger = QueuedInsertTrigger(
            project_id=self.project_id,
            zone=self.zone,
            resource_id=self.resource_id,
            deadline=time.time() + (minutes + QUEUE_MARGIN_MINUTES) * 60,
            operation=operation,
            gcp_conn_id=self.gcp_conn_id,
            poll_interval=self.capacity_poll_seconds,
            impersonation_chain=self.impersonation_chain,
            first_read_after=self.capacity_first_read_seconds,
        )
        self.defer(trigger=trigger, method_name="resume_after_queue")

    def resume_after_queue(self, context, event: dict) -> dict:
        """Back from QueuedInsertTrigger: the RUNNING VM is the task's result; a request that
        ended without a machine fails the run, naming why."""
        waited = f"{event['queued_seconds'] / 60:.1f} minutes"
        where = f"VM {self.resource_id} (flex_start_valid_minutes={self.queue_minutes})"
        if event["status"] == "running":
            self.log.info("The flex-start request got its machine after %s: %s is RUNNING", waited, self.resource_id)
            hook = endpoint_hook_for(self)
            return Instance.to_dict(
                hook.get_instance(resource_id=self.resource_id, project_id=self.project_id, zone=self.zone)
            )
        if event["status"] == "timeout":
            raise AirflowFailException(
                f"The flex-start request for {where} was still queued after {waited}, past its validity; "
                "nothing was billed, and delete_vm removes it"
            )
        operation = event.get("operation") or {}
        verdict = classify(OperationFailed(operation)) if operation.get("error") else None
        cause = str(verdict) if verdict else f"the instance is {event.get('instance_status') or 'gone'}"
        raise AirflowFailException(
            f"The flex-start request for {where} expired after {waited} without a machine: {cause}; "
            "nothing was billed, and delete_vm removes what is left"
        )

    def _wait_out_stockout(self, deadline: float | None, refusal: str) -> NoReturn:
        """Defer, then ask for the VM again (no reservation to read): fail once the deadline has passed.
        Each ask is a deferral of its own, so its pause also waits out the executor's report of it
        (capacity_first_read_seconds, apache/airflow#72716): under the real scheduler a 2 s pause
        lost a try that had just made the VM (its retry adopted it)."""
        if deadline is None:
            deadline = time.time() + float(self.max_capacity_wait_minutes) * 60
        if time.time() >= deadline:
            raise AirflowFailException(f"{self._gave_up(None, deadline)}; the cloud's last refusal: {refusal}")
        pause = stockout_pause(self.capacity_poll_seconds, self.capacity_first_read_seconds)
        self.log.info(
            "Waiting (deferred, no worker slot) %.0f s before asking again, at most until %s",
            pause, time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(deadline)),
        )
        self.defer(trigger=StockoutWaitTrigger(deadline, pause), method_name="resume_after_capacity_wait")

    def _gave_up(self, count: int | None, deadline: float) -> str:
        limit = float(self.max_capacity_wait_minutes)
        waited = max(0.0, time.time() - (deadline - limit * 60))
        how_long = f"{waited / 60:.0f} minutes" if waited >= 60 else f"{waited:.0f} seconds"
        where = (
            f"no free capacity in reservation {self.reservation} (count {count})" if self.reservation
            else f"zone {self.zone} had no machine for it"
        )
        return f"Gave up waiting for a machine: {where} for {how_long} (max_capacity_wait_minutes={limit:g}); no VM was created"


class DeleteVmOperator(ComputeEngineDeleteInstanceOperator):
    """Delete the instance and confirm it is gone; an instance that is already gone is success."""

    def execute(self, context) -> None:
        self._validate_inputs()
        hook = endpoint_hook_for(self)
        try:
            hook.get_instance(resource_id=self.resource_id, project_id=self.project_id, zone=self.zone)
            self.log.info("Deleting instance %s", self.resource_id)
            hook.delete_instance(
                resource_id=self.resource_id,
                project_id=self.project_id,
                request_id=self.request_id,
                zone=self.zone,
            )
        except NotFound:
            self.log.info("Instance %s does not exist (never created or already deleted)", self.resource_id)
            return
        try:
            hook.get_instance(resource_id=self.resource_id, project_id=self.project_id, zone=self.zone)
        except NotFound:
            self.log.info("Instance %s is deleted", self.resource_id)
            return
        raise AirflowException(f"Instance {self.resource_id} still exists after its delete operation finished")


class StopVmOperator(ComputeEngineStopInstanceOperator):
    """The provider's stop (instances.stop, then its zone operation) on the endpoint-aware hook; a
    stopped VM keeps its boot disk, so an image can be made of it."""

    def execute(self, context) -> None:
        self._validate_inputs()
        endpoint_hook_for(self).stop_instance(zone=self.zone, resource_id=self.resource_id, project_id=self.project_id)
        self.log.info("Instance %s is stopped", self.resource_id)


class CreateImageOperator(BaseOperator):
    """Make an image of a stopped VM's boot disk (images.insert with sourceDisk, in a family) and
    wait until it is READY. A retry finds the image its first try made (same name, same source
    disk) and waits for it instead of asking again; a name taken by another image fails at once."""

    template_fields: Sequence[str] = ("project_id", "body")

    def __init__(self, *, project_id: str, body: dict, gcp_conn_id: str, poll_seconds: float = 10, **kwargs):
        super().__init__(**kwargs)
        self.project_id = project_id
        self.body = body
        self.gcp_conn_id = gcp_conn_id
        self.poll_seconds = poll_seconds

    def execute(self, context) -> dict:
        hook = ComputeEngineEndpointHook(gcp_conn_id=self.gcp_conn_id)
        name = self.body["name"]
        existing = hook.get_image(name=name, project_id=self.project_id)
        if existing is None:
            request_id = insert_request_id(f"{self.project_id}/{name}", context["ti"].try_number)
            self.log.info("Creating image %s in family %s from %s", name, self.body["family"], self.body["sourceDisk"])
            hook.insert_image(body=self.body, project_id=self.project_id, request_id=request_id)
        elif not existing.get("sourceDisk", "").endswith(self.body["sourceDisk"]):
            raise AirflowFailException(
                f"Image {name} already exists in {self.project_id}, made from {existing.get('sourceDisk')}: "
                "choose another image_name"
            )
        else:
            self.log.info("Image %s was asked for by an earlier try (%s)", name, existing["status"])
        while (image := hook.get_image(name=name, project_id=self.project_id)) and image["status"] == "PENDING":
            time.sleep(self.poll_seconds)  # an earlier try's image is still being made
        if image is None or image["status"] != "READY":
            raise AirflowException(f"Image {name} is not READY: {image and image['status']}")
        self.log.info("Image %s is READY in family %s (%s bytes)", name, image.get("family"), image.get("archiveSizeBytes"))
        return {key: image.get(key) for key in ("name", "family", "selfLink", "status", "labels")}
