"""Recreate a VM lost mid-training and resume its training from the latest durable checkpoint.

Airflow cannot retry a group of tasks, so the training sensor does it: when the Compute API no
longer knows the run's VM, `VmRecovery.recover` creates it again (same name, body and lifetime),
waits for SSH, runs the install, convert and start-training steps on it, and returns; the sensor
then watches the new VM. MaxText restores the latest checkpoint under the run's run_name in the
output location, so no step up to it is trained again.

The new VM passes the capacity gate first: while its reservation has no machine free, or the
cloud refuses the insert for capacity, nothing is counted and the sensor's next poke tries again
(rescheduled: no worker slot held), up to max_capacity_wait_minutes.

The bound: once its insert was accepted, each recovery writes `vm-recoveries/N.json` into the
run's output folder (create-only, so two pokes cannot both take number N; the VM's label says N,
so a try cut short between the two is recorded by the next), and there are at most
max_vm_recoveries of them. The ledger lives in storage because a sensor's XCom is cleared at
every reschedule, and storage is where the checkpoints are anyway: without an output location
there is nothing to resume from, and the run fails saying so.
"""

from __future__ import annotations

import json
import re
import time
import uuid
from typing import Any

from google.api_core.exceptions import NotFound

from airflow.sdk.exceptions import AirflowException, AirflowFailException
from maxtext_sft.cloud_errors import Action, classify
from maxtext_sft.hooks.compute import ComputeEngineEndpointHook
from maxtext_sft.hooks.storage import StorageEndpointHook, split_gcs_uri
from maxtext_sft.instances import adoptable_instance, with_expiry_label
from maxtext_sft.vm_access import SshLoginProbe, run_vm_step
from maxtext_sft.spec import RunSpec

# Label of a recreated VM: which recovery made it (the ledger entry is written after its insert).
RECOVERY_LABEL = "maxtext-sft-recovery"
# The ledger: N.json per recovery (create-once, counted), N-resumed.json once its training resumed.
LEDGER_ENTRY = re.compile(r"[0-9]+\.json")
SSH_WAIT_SECONDS = 600  # as long as wait_for_ssh waits for the first VM
SSH_CHECK_INTERVAL_SECONDS = 5


class VmRecovery:
    def __init__(self, spec: RunSpec, *, gcp_conn_id: str, ssh_conn_id: str, hf_conn_id: str, log: Any):
        self.spec = spec
        self.connections = {"gcp_conn_id": gcp_conn_id, "ssh_conn_id": ssh_conn_id, "hf_conn_id": hf_conn_id}
        self.log = log

    def count(self) -> int:
        """Recoveries this run has made so far (its ledger's entries)."""
        if not self.spec.durable:
            return 0
        storage = StorageEndpointHook(gcp_conn_id=self.connections["gcp_conn_id"])
        return sum(1 for name in storage.names_under(self.spec.vm_recoveries_uri) if LEDGER_ENTRY.fullmatch(name))

    def recover(self, reason: str, *, replace: bool = False, lost_after_step: int | None = None) -> bool:
        """Recreate the VM and resume training on it (True), or, while the reservation has no
        machine free, nothing: False, and the next poke tries again (the sensor bounds the wait).
        Fails the task saying why when it cannot recover. `replace`: the VM still exists but is
        useless (it stopped answering): it is deleted first. `lost_after_step`: the last step the
        sensor saw trained on the lost VM, for the record."""
        spec = self.spec
        if not spec.durable:
            raise AirflowFailException(
                f"{reason}. Its checkpoints lived only on that VM (no output_location), so the training "
                "cannot resume; set output_location to make a lost VM recoverable"
            )
        made = self.count()
        if made >= spec.max_vm_recoveries:
            raise AirflowFailException(
                f"{reason}, and this run has already recreated its VM {made} time(s) "
                f"(max_vm_recoveries={spec.max_vm_recoveries}): not recovering again"
            )
        if replace:
            self._delete_vm()
        number = made + 1
        if not self._machine_free(reason) or not self._create_vm(number, reason):
            return False
        self._record(number, reason, lost_after_step)
        self.resume(number)
        return True

    def _record(self, number: int, reason: str, lost_after_step: int | None = None) -> None:
        """Count recovery `number` in the ledger, once its insert was accepted."""
        spec = self.spec
        storage = StorageEndpointHook(gcp_conn_id=self.connections["gcp_conn_id"])
        committed = storage.committed_steps(spec.checkpoints_dir)
        entry = {
            "recovery": number,
            "reason": reason,
            "resumes_after_step": committed[-1] if committed else None,
            "lost_after_step": lost_after_step,
            "at": int(time.time()),
        }
        if not storage.create_once(f"{spec.vm_recoveries_uri}/{number}.json", json.dumps(entry)):
            raise AirflowException(f"recovery {number} of {spec.run_name} was taken by another try: checking again")
        self.log.warning(
            "%s. Recovery %d of at most %d: recreated it; training resumes after step %s "
            "(the latest committed checkpoint)",
            reason, number, spec.max_vm_recoveries, entry["resumes_after_step"],
        )

    def record_unrecorded(self) -> bool:
        """A recreated VM whose recovery a cut-short try did not get to record (its insert
        label says which): record it now. False when the VM is no recovery's."""
        spec = self.spec
        hook = ComputeEngineEndpointHook(gcp_conn_id=self.connections["gcp_conn_id"])
        try:
            instance = hook.get_instance(resource_id=spec.vm_name, zone=spec.zone, project_id=spec.project_id)
        except NotFound:
            return False
        number = dict(instance.labels).get(RECOVERY_LABEL, "")
        if not number.isdigit() or int(number) <= self.count():
            return False
        self._record(int(number), "the VM was recreated by a try that did not record it")
        return True

    def resume(self, number: int | None = None) -> None:
        """Bring the (recreated) VM to where start_training left the first one, resuming training;
        each step's time goes to the log and, beside recovery `number`'s entry (default: the
        latest), to `N-resumed.json`."""
        seconds: dict[str, float] = {}

        def timed(step: str, run: Any) -> Any:
            started = time.monotonic()
            result = run()
            seconds[step] = round(time.monotonic() - started, 1)
            self.log.info("Recovery of %s: %s took %.1f s", self.spec.vm_name, step, seconds[step])
            return result

        on_vm = {"spec": self.spec, "log": self.log, **self.connections}
        timed("wait_for_ssh", self._wait_for_ssh)
        timed("install", lambda: run_vm_step("install", results={}, **on_vm))
        converted = timed("convert", lambda: run_vm_step("convert", results={}, **on_vm)) or {}  # the shared cache
        timed("start_training", lambda: run_vm_step("start_training", results={**converted, "resuming": "yes"}, **on_vm))
        self.log.info("Training %s resumed on the recreated VM %s", self.spec.run_name, self.spec.vm_name)
        number = number or self.count()
        if number:
            StorageEndpointHook(gcp_conn_id=self.connections["gcp_conn_id"]).upload(
                *split_gcs_uri(f"{self.spec.vm_recoveries_uri}/{number}-resumed.json"),
                data=json.dumps({"recovery": number, "resumed_at": int(time.time()), "step_seconds": seconds}),
                mime_type="application/json",
            )

    def _delete_vm(self) -> None:
        spec = self.spec
        hook = ComputeEngineEndpointHook(gcp_conn_id=self.connections["gcp_conn_id"])
        try:
            hook.delete_instance(resource_id=spec.vm_name, zone=spec.zone, project_id=spec.project_id, request_id=None)
        except NotFound:
            return
        self.log.info("Deleted the unreachable instance %s", spec.vm_name)

    def _machine_free(self, reason: str) -> bool:
        """Whether the reservation has a machine for the new VM: the capacity gate create_vm has
        too, so a recovery does not take, or wait in a refused insert for, another run's machine."""
        spec = self.spec
        if not spec.reservation:
            return True
        hook = ComputeEngineEndpointHook(gcp_conn_id=self.connections["gcp_conn_id"])
        capacity = hook.reservation_capacity(name=spec.reservation, zone=spec.zone, project_id=spec.project_id)
        if capacity is None:
            raise AirflowFailException(f"{reason}; it cannot be recreated: reservation {spec.reservation} does not exist")
        count, in_use = capacity
        if count - in_use >= 1:
            return True
        self.log.warning(
            "%s. Reservation %s has %d of %d machines in use: waiting for one (no VM asked for, no recovery counted)",
            reason, spec.reservation, in_use, count,
        )
        return False

    def _create_vm(self, number: int, reason: str) -> bool:
        """Insert the VM again (labelled as recovery `number`); False when the cloud refused it for
        capacity (the gate's wait then goes on). Other refusals act as cloud_errors says."""
        spec = self.spec
        hook = ComputeEngineEndpointHook(gcp_conn_id=self.connections["gcp_conn_id"])
        where = {"resource_id": spec.vm_name, "project_id": spec.project_id, "zone": spec.zone}
        if adoptable_instance(hook, where, self.log) is not None:
            return True
        body = with_expiry_label(spec.instance_body(), spec.max_run_duration_minutes)
        body["labels"] = {**body["labels"], RECOVERY_LABEL: str(number)}
        try:
            hook.insert_instance(
                body=body,
                zone=spec.zone,
                project_id=spec.project_id,
                # One per insert: the API answers a repeated request id with its first operation,
                # and an insert refused for capacity is asked again under the same number.
                request_id=str(uuid.uuid4()),
            )
        except Exception as error:
            verdict = classify(error)
            if verdict is None or verdict.action is Action.RETRY:
                raise  # the sensor's retries take it, as create_vm's do
            if verdict.action is Action.WAIT_FOR_CAPACITY:
                self.log.warning("%s. The cloud refused its recreation for capacity (%s): waiting", reason, verdict)
                return False
            raise AirflowFailException(f"{reason}; Compute Engine refused to recreate it: {verdict}") from error
        self.log.info("Recreated instance %s (recovery %d)", spec.vm_name, number)
        return True

    def _wait_for_ssh(self) -> None:
        deadline = time.monotonic() + SSH_WAIT_SECONDS
        login_works = SshLoginProbe(self.spec, self.connections["gcp_conn_id"], self.connections["ssh_conn_id"], self.log)
        while not login_works():
            if time.monotonic() > deadline:
                raise AirflowException(f"the recreated VM {self.spec.vm_name} did not answer SSH in {SSH_WAIT_SECONDS} s")
            time.sleep(SSH_CHECK_INTERVAL_SECONDS)  # polling interval: the VM is asked again each time
