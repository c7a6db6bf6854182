"""Recreate a VM lost mid-training and resume its training from the latest durable checkpoint.

Airflow cannot retry a group of tasks, so the training sensor does it, one poke at a time, so
that no worker slot is held while anything is waited for:
  1. the VM is lost (gone, stopped, or answering no SSH for unreachable_timeout_seconds):
     `VmRecovery.recover` passes the capacity gate and inserts it again (same name, body and
     lifetime; vm/remake.py), and counts the recovery; while no machine is free, the sensor
     defers to the capacity trigger and comes back;
  2. the next pokes find the new VM booting (no SSH yet) and are rescheduled;
  3. the first poke that reaches it finds no training there, and `resume` starts the VM's
     autostop and runs the install, convert and start-training steps on it (each step's seconds in the task log), as the
     DAG's own tasks did on the first VM;
  4. the pokes after that watch the resumed training.
MaxText restores the latest checkpoint under the run's run_name in the output location, so no
step up to it is trained again.

The bound: once its insert was accepted, each recovery writes `vm-recoveries/N.json` into the
run's output folder (create-only, so two pokes cannot both take number N; the VM's label says N,
so a try cut short between the two is recorded by the next), and there are at most
max_vm_recoveries of them. A Spot VM's preemption (a `compute.instances.preempted` operation the
ledger has not yet counted) is a recovery too, marked `preempted`, but bounded by max_preemptions
instead: the cloud took the machine back, nothing failed. The ledger lives in storage because a sensor's XCom is cleared at
every reschedule, and storage is where the checkpoints are anyway: without an output location
there is nothing to resume from, and the run fails saying so.
"""

from __future__ import annotations

import json
import time
from typing import Any

from google.api_core.exceptions import NotFound

from airflow.sdk.exceptions import AirflowException, AirflowFailException
from maxtext_sft.cloud.compute import ComputeEngineEndpointHook
from maxtext_sft.cloud.storage import StorageEndpointHook, split_gcs_uri
from maxtext_sft.run.names import ledger_entry_name, ledger_entry_number, ledger_resumed_name
from maxtext_sft.run.spec import RunSpec
from maxtext_sft.vm.access import run_vm_steps
from maxtext_sft.vm.remake import VmRemake
from maxtext_sft.vm.steps import steps_before

# Label of a recreated VM: which recovery made it (the ledger entry is written after its insert).
RECOVERY_LABEL = "maxtext-sft-recovery"


class VmRecovery:
    def __init__(self, spec: RunSpec, *, gcp_conn_id: str, ssh_conn_id: str, hf_conn_id: str, log: Any):
        self.spec = spec
        self.connections = {"gcp_conn_id": gcp_conn_id, "ssh_conn_id": ssh_conn_id, "hf_conn_id": hf_conn_id}
        self.log = log
        self.remake = VmRemake(spec, gcp_conn_id=gcp_conn_id, ssh_conn_id=ssh_conn_id, log=log)

    def count(self) -> int:
        """Recoveries this run has made so far (its ledger's entries), preemptions included."""
        if not self.spec.durable:
            return 0
        storage = StorageEndpointHook(gcp_conn_id=self.connections["gcp_conn_id"])
        return sum(1 for name in storage.names_under(self.spec.vm_recoveries_uri) if ledger_entry_number(name) is not None)

    def preemptions_counted(self) -> int:
        """The ledger's entries that were preemptions (each entry read: a Spot run's only)."""
        if self.spec.capacity != "spot" or self.spec.rehearsal:
            return 0
        storage = StorageEndpointHook(gcp_conn_id=self.connections["gcp_conn_id"])
        names = [name for name in storage.names_under(self.spec.vm_recoveries_uri) if ledger_entry_number(name) is not None]
        return sum(
            1 for name in names
            if json.loads(storage.read_text(f"{self.spec.vm_recoveries_uri}/{name}")).get("preempted")
        )

    def preemption(self, counted: int | None = None) -> dict | None:
        """The newest `compute.instances.preempted` operation of the run's VM name that the ledger
        has not counted yet (`counted`: its preemptions, read if not given; each preemption is
        counted once, oldest first), or None: the loss was no preemption. Only a Spot VM is preempted."""
        if self.spec.capacity != "spot" or self.spec.rehearsal:
            return None
        hook = ComputeEngineEndpointHook(gcp_conn_id=self.connections["gcp_conn_id"])
        found = hook.preemptions(resource_id=self.spec.vm_name, zone=self.spec.zone, project_id=self.spec.project_id)
        counted = self.preemptions_counted() if counted is None else counted
        return found[-1] if len(found) > counted else None

    def recover(
        self, reason: str, *, replace: bool = False, lost_after_step: int | None = None, waited_since: float | None = None
    ) -> bool:
        """Recreate the VM and count the recovery (True: the pokes that reach the new VM resume
        the training on it), or, while the reservation has no machine free, nothing: False, and
        the sensor waits for one (it bounds the wait).
        Fails the task saying why when it cannot recover. `replace`: the VM still exists but is
        useless (it stopped answering): it is deleted first. `lost_after_step`: the last step the
        sensor saw trained on the lost VM, and `waited_since`, when its wait for a machine began
        (None: no wait), for the record."""
        spec = self.spec
        if not spec.durable:
            raise AirflowFailException(
                f"{reason}. Its checkpoints lived only on that VM (no output_location), so the training "
                "cannot resume; set output_location to make a lost VM recoverable"
            )
        made = self.count()
        taken = self.preemptions_counted()  # the ledger read once for both
        preempted = self.preemption(counted=taken)
        if preempted is not None:
            reason = f"{reason}; the cloud preempted the Spot VM at {preempted.get('insertTime', '?')}"
            if taken >= spec.max_preemptions:
                raise AirflowFailException(
                    f"{reason}, and this run has already been preempted {taken} time(s) "
                    f"(max_preemptions={spec.max_preemptions}): not resuming again"
                )
        elif made - taken >= spec.max_vm_recoveries:
            raise AirflowFailException(
                f"{reason}, and this run has already recreated its VM {made - taken} time(s) "
                f"(max_vm_recoveries={spec.max_vm_recoveries}): not recovering again"
                + (f" (its {taken} preemption(s) not counted)" if taken else "")
            )
        if replace:
            self.remake.delete()
        number = made + 1
        if not self.remake.machine_free(reason):
            return False
        machine_found = time.time()
        if not self.remake.insert(reason, {RECOVERY_LABEL: str(number)}):
            return False
        self._record(
            number, reason, lost_after_step, (waited_since, machine_found) if waited_since else None,
            preempted=preempted is not None,
        )
        return True

    def _record(
        self,
        number: int,
        reason: str,
        lost_after_step: int | None = None,
        waited: tuple[float, float] | None = None,
        *,
        preempted: bool = False,
    ) -> None:
        """Count recovery `number` in the ledger, once its insert was accepted."""
        spec = self.spec
        storage = StorageEndpointHook(gcp_conn_id=self.connections["gcp_conn_id"])
        committed = storage.committed_steps(spec.checkpoints_dir)
        entry = {
            "recovery": number,
            "reason": reason,
            "resumes_after_step": committed[-1] if committed else None,
            "lost_after_step": lost_after_step,
            # From the first poke that found no machine to the one that found one (bench/recovery_slots.py).
            "capacity_wait": [round(t, 3) for t in waited] if waited else None,
            "at": round(time.time(), 3),  # the insert was accepted
            "preempted": preempted,  # a Spot preemption: bounded by max_preemptions, not max_vm_recoveries
        }
        if not storage.create_once(f"{spec.vm_recoveries_uri}/{ledger_entry_name(number)}", json.dumps(entry)):
            raise AirflowException(f"recovery {number} of {spec.run_name} was taken by another try: checking again")
        self.log.warning(
            "%s. %s %d: recreated it; training resumes after step %s (the latest committed checkpoint)",
            reason, "Preemption" if preempted else "Recovery", number, entry["resumes_after_step"],
        )
        self.log.info("Recovery %d: the next pokes wait for the new VM's SSH (rescheduled), then resume on it", number)

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
        """Bring the recreated VM, which answers SSH, to where start_training left the first one,
        resuming training; each step's time goes to the log and, beside recovery `number`'s entry
        (default: the latest), to `N-resumed.json`. "wait_for_ssh" is the time from the insert
        (the entry's) to this call: the pokes that found the new VM booting."""
        number = number or self.count()
        storage = StorageEndpointHook(gcp_conn_id=self.connections["gcp_conn_id"])
        seconds: dict[str, float] = {}
        if number:
            entry = json.loads(storage.read_text(f"{self.spec.vm_recoveries_uri}/{ledger_entry_name(number)}"))
            if "at" in entry:
                seconds["wait_for_ssh"] = round(max(0.0, time.time() - entry["at"]), 1)
                self.log.info(
                    "Recovery of %s: the new VM answered SSH %.1f s after its insert", self.spec.vm_name, seconds["wait_for_ssh"]
                )

        # The conversion is found in the shared cache; its path reaches start_training.
        _, step_seconds = run_vm_steps(
            ("autostop", *steps_before("start_training", self.spec), "start_training"), self.spec, {"resuming": "yes"},
            what=f"Recovery of {self.spec.vm_name}", log=self.log, **self.connections,
        )
        seconds |= step_seconds
        self.log.info("Training %s resumed on the recreated VM %s", self.spec.run_name, self.spec.vm_name)
        if number:
            storage.upload(
                *split_gcs_uri(f"{self.spec.vm_recoveries_uri}/{ledger_resumed_name(number)}"),
                data=json.dumps({"recovery": number, "resumed_at": int(time.time()), "step_seconds": seconds}),
                mime_type="application/json",
            )
