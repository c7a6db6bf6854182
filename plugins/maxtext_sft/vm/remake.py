"""Make the run's VM again after it was lost: the capacity gate, the insert, the wait for SSH.

Below the training sensor's recovery (vm/recovery.py, which counts and resumes) and the VM step
tasks, which make the VM again when it is gone as they start (a task cleared after the run's VM
was deleted, a VM lost between two tasks). The VM is made as create_vm made it: same name, body
and lifetime, the same capacity gate in front of the insert.

While the reservation has no machine free, or the cloud refuses the insert for capacity (a
stockout, for a run with no reservation), nothing is asked for: the caller waits holding no
worker slot (it defers to ReservationCapacityTrigger or StockoutWaitTrigger,
`capacity_wait_trigger`) and comes back.
"""

from __future__ import annotations

import time
import uuid
from typing import Any

from google.api_core.exceptions import NotFound

from airflow.sdk.exceptions import AirflowException, AirflowFailException
from maxtext_sft.cloud.errors import Action, classify, waits_for_capacity
from maxtext_sft.cloud.compute import ComputeEngineEndpointHook
from maxtext_sft.cloud.instances import adoptable_instance, insert_with_fallback, with_expiry_label
from maxtext_sft.run.spec import RunSpec
from maxtext_sft.cloud.capacity import ReservationCapacityTrigger, StockoutWaitTrigger, stockout_pause
from maxtext_sft.vm.access import SshLoginProbe, start_autostop

SSH_WAIT_SECONDS = 600  # as long as wait_for_ssh waits for the first VM
SSH_CHECK_INTERVAL_SECONDS = 5


class VmRemake:
    def __init__(self, spec: RunSpec, *, gcp_conn_id: str, ssh_conn_id: str | None, log: Any):
        self.spec = spec
        self.gcp_conn_id = gcp_conn_id
        self.ssh_conn_id = ssh_conn_id
        self.log = log

    @property
    def _where(self) -> dict:
        return {"resource_id": self.spec.vm_name, "project_id": self.spec.project_id, "zone": self.spec.zone}

    def status(self) -> str | None:
        """The instance's status, None when it is gone."""
        try:
            return ComputeEngineEndpointHook(gcp_conn_id=self.gcp_conn_id).get_instance(**self._where).status
        except NotFound:
            return None

    def delete(self) -> None:
        try:
            ComputeEngineEndpointHook(gcp_conn_id=self.gcp_conn_id).delete_instance(request_id=None, **self._where)
        except NotFound:
            return
        self.log.info("Deleted the instance %s", self.spec.vm_name)

    def machine_free(self, reason: str) -> bool:
        """Whether the reservation has a machine for the new VM: the capacity gate create_vm has
        too, so a remade VM does not take, or wait in a refused insert for, another run's machine."""
        spec = self.spec
        if not spec.consumed_reservation:
            return True
        hook = ComputeEngineEndpointHook(gcp_conn_id=self.gcp_conn_id)
        capacity = hook.reservation_capacity(name=spec.reservation, zone=spec.zone, project_id=spec.project_id)
        if capacity is None:
            raise AirflowFailException(f"{reason}; it cannot be made again: reservation {spec.reservation} does not exist")
        count, in_use = capacity
        if count - in_use >= 1:
            return True
        self.log.warning(
            "%s. Reservation %s has %d of %d machines in use: waiting for one (no VM asked for)",
            reason, spec.reservation, in_use, count,
        )
        return False

    def insert(self, reason: str, labels: dict[str, str] | None = None) -> bool:
        """Insert the VM again (with `labels` over the run's); False when the cloud refused it for
        capacity (the wait goes on). Other refusals act as cloud_errors says. A live instance of
        the name is adopted; a stopped or failed one is deleted first."""
        spec = self.spec
        hook = ComputeEngineEndpointHook(gcp_conn_id=self.gcp_conn_id)
        if adoptable_instance(hook, self._where, self.log) is not None:
            return True
        body = with_expiry_label(spec.instance_body(), spec.max_run_duration_minutes)
        body["labels"] = {**body["labels"], **(labels or {})}
        # One per insert: the API answers a repeated request id with its first operation, and an
        # insert refused for capacity is asked again. A flex-start request's operation lasts as
        # long as it is queued: it is not waited for (the pokes see the VM PENDING, then booting).
        insert = hook.start_insert_instance if spec.queued_insert else hook.insert_instance
        try:
            # Without a field the cloud refuses, as create_vm does (cloud.instances.UNSOURCED_FIELDS).
            insert_with_fallback(
                lambda body, request_id: insert(body=body, zone=spec.zone, project_id=spec.project_id, request_id=request_id),
                body, str(uuid.uuid4()), self.log, before_again=lambda: adoptable_instance(hook, self._where, self.log),
            )
        except Exception as error:
            verdict = classify(error)
            if waits_for_capacity(verdict, waits_out_stockouts=spec.waits_out_stockouts):
                self.log.warning("%s. The cloud refused to make it again for capacity (%s): waiting", reason, verdict)
                return False
            if verdict is None or verdict.action is Action.RETRY:
                raise  # the task's retries take it, as create_vm's do
            raise AirflowFailException(f"{reason}; Compute Engine refused to make it again: {verdict}") from error
        self.log.info("Made instance %s again", spec.vm_name)
        return True

    def capacity_wait_trigger(self, deadline: float, *, poll_seconds: float, first_read_seconds: float):
        """The trigger a task defers to while there is no machine: the reservation's, or a pause
        before asking again through a stockout; None when neither applies (a rehearsal: the
        caller's retries take it)."""
        spec = self.spec
        if not spec.consumed_reservation:
            if not spec.waits_out_stockouts:
                return None
            return StockoutWaitTrigger(deadline, stockout_pause(poll_seconds, first_read_seconds))
        return ReservationCapacityTrigger(
            project_id=spec.project_id,
            zone=spec.zone,
            reservation=spec.reservation,
            deadline=deadline,
            gcp_conn_id=self.gcp_conn_id,
            poll_interval=poll_seconds,
            first_read_after=first_read_seconds,
        )

    def wait_for_login(self) -> float:
        """Wait until the new VM takes the pipeline's SSH login (as wait_for_ssh does for the
        first VM, in poke mode), and start its autostop; return the seconds it took."""
        started = time.monotonic()
        login_works = SshLoginProbe(self.spec, self.gcp_conn_id, self.ssh_conn_id, self.log)
        while not login_works():
            if time.monotonic() - started > SSH_WAIT_SECONDS:
                raise AirflowException(f"the new VM {self.spec.vm_name} did not answer SSH in {SSH_WAIT_SECONDS} s")
            time.sleep(SSH_CHECK_INTERVAL_SECONDS)  # polling interval: the VM is asked again each time
        start_autostop(self.spec, self.gcp_conn_id, self.ssh_conn_id, self.log)
        return round(time.monotonic() - started, 1)
