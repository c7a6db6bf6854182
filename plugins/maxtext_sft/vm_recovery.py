"""Recreate a VM lost mid-training and resume its training from the latest durable checkpoint.

Airflow cannot retry a group of tasks, so the training sensor does it: when the Compute API no
longer knows the run's VM, `VmRecovery.recover` creates it again (same name, body and lifetime),
waits for SSH, runs the install, convert and start-training steps on it, and returns; the sensor
then watches the new VM. MaxText restores the latest checkpoint under the run's run_name in the
output location, so no step up to it is trained again.

The bound: each recovery first writes `vm-recoveries/N.json` into the run's output folder
(create-only, so two pokes cannot both take number N), and there are at most max_vm_recoveries
of them. The ledger lives in storage because a sensor's XCom is cleared at every reschedule, and
storage is where the checkpoints are anyway: without an output location there is nothing to
resume from, and the run fails saying so.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Any

from airflow.sdk.exceptions import AirflowException, AirflowFailException
from maxtext_sft.hooks.compute import ComputeEngineEndpointHook
from maxtext_sft.hooks.storage import StorageEndpointHook
from maxtext_sft.instances import adoptable_instance, with_expiry_label
from maxtext_sft.vm_access import SshLoginProbe, run_vm_step
from maxtext_sft.spec import RunSpec

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
        return sum(1 for name in storage.names_under(self.spec.vm_recoveries_uri) if name.endswith(".json"))

    def recover(self, reason: str) -> None:
        """Recreate the VM and resume training on it, or fail the task saying why it cannot."""
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
        storage = StorageEndpointHook(gcp_conn_id=self.connections["gcp_conn_id"])
        committed = storage.committed_steps(spec.checkpoints_dir)
        number = made + 1
        entry = {
            "recovery": number,
            "reason": reason,
            "resumes_after_step": committed[-1] if committed else None,
            "at": int(time.time()),
        }
        if not storage.create_once(f"{spec.vm_recoveries_uri}/{number}.json", json.dumps(entry)):
            raise AirflowException(f"recovery {number} of {spec.run_name} was taken by another try: checking again")
        self.log.warning(
            "%s. Recovery %d of at most %d: recreating it; training resumes after step %s "
            "(the latest committed checkpoint)",
            reason, number, spec.max_vm_recoveries, entry["resumes_after_step"],
        )
        self._create_vm(number)
        self.resume()

    def resume(self) -> None:
        """Bring the (recreated) VM to where start_training left the first one, resuming training."""
        self._wait_for_ssh()
        on_vm = {"spec": self.spec, "log": self.log, **self.connections}
        run_vm_step("install", results={}, **on_vm)
        converted = run_vm_step("convert", results={}, **on_vm) or {}  # found in the shared cache
        run_vm_step("start_training", results={**converted, "resuming": "yes"}, **on_vm)
        self.log.info("Training %s resumed on the recreated VM %s", self.spec.run_name, self.spec.vm_name)

    def _create_vm(self, number: int) -> None:
        spec = self.spec
        hook = ComputeEngineEndpointHook(gcp_conn_id=self.connections["gcp_conn_id"])
        where = {"resource_id": spec.vm_name, "project_id": spec.project_id, "zone": spec.zone}
        if adoptable_instance(hook, where, self.log) is not None:
            return
        hook.insert_instance(
            body=with_expiry_label(spec.instance_body(), spec.max_run_duration_minutes),
            zone=spec.zone,
            project_id=spec.project_id,
            # Per recovery: the API answers a repeated request id with its first operation.
            request_id=str(uuid.uuid5(uuid.NAMESPACE_URL, f"{spec.request_id}/recovery-{number}")),
        )
        self.log.info("Recreated instance %s", spec.vm_name)

    def _wait_for_ssh(self) -> None:
        deadline = time.monotonic() + SSH_WAIT_SECONDS
        login_works = SshLoginProbe(self.spec, self.connections["gcp_conn_id"], self.connections["ssh_conn_id"], self.log)
        while not login_works():
            if time.monotonic() > deadline:
                raise AirflowException(f"the recreated VM {self.spec.vm_name} did not answer SSH in {SSH_WAIT_SECONDS} s")
            time.sleep(SSH_CHECK_INTERVAL_SECONDS)  # polling interval: the VM is asked again each time
