"""Run one step script from include/vm on the run's VM over SSH; make the VM again if it is gone."""

from __future__ import annotations

import time
from collections.abc import Sequence

from airflow.sdk.exceptions import AirflowException, AirflowFailException
from maxtext_sft.cloud.storage import StorageEndpointHook
from maxtext_sft.cloud.instances import LIVE_STATUSES
from maxtext_sft.tasks.base import RunTaskOperator
from maxtext_sft.cloud.capacity import CAPACITY_FIRST_READ_SECONDS, CAPACITY_POLL_SECONDS
from maxtext_sft.vm.slice_hosts import HostLog, check_hosts_running, on_every_host
from maxtext_sft.run.spec import RunSpec
from maxtext_sft.vm.access import run_vm_step, run_vm_steps
from maxtext_sft.vm.remake import VmRemake
from maxtext_sft.vm.steps import STEPS, steps_before


class VmScriptOperator(RunTaskOperator):
    """Upload the step scripts and run `step`'s script; the HF token goes on stdin, never in argv.

    The script's output streams into the task log as it comes. What the script reports with
    `report_result` (paths, never secrets) is the task's XCom; `results` passes an earlier step's
    XCom in (e.g. the converted checkpoint's path to the training step).

    When the run's VM is gone or stopped as the task starts (the task was cleared after the run
    deleted its VM, or the VM was lost between two tasks), the task makes it again as create_vm
    did (same name and body, the capacity gate: deferred, holding no worker slot, while the
    reservation is full, up to max_capacity_wait_minutes), waits for its SSH, runs the earlier
    steps this one needs on it (vm.steps.steps_before; each is safe to run twice), then its own.
    """

    template_fields: Sequence[str] = ("spec", "hosts", "results")
    ui_color = "#e8f4ea"

    def __init__(
        self,
        *,
        step: str,
        ssh_conn_id: str,
        hf_conn_id: str,
        results=None,
        capacity_poll_seconds: float = CAPACITY_POLL_SECONDS,
        capacity_first_read_seconds: float = CAPACITY_FIRST_READ_SECONDS,
        **kwargs,
    ):
        super().__init__(ssh_conn_id=ssh_conn_id, hf_conn_id=hf_conn_id, **kwargs)
        if step not in STEPS:
            raise ValueError(f"unknown VM step {step!r}; known: {sorted(STEPS)}")
        self.step = step
        self.results = results
        self.capacity_poll_seconds = capacity_poll_seconds
        self.capacity_first_read_seconds = capacity_first_read_seconds

    def execute(self, context) -> dict[str, str] | None:
        return self._run(context, deadline=None)

    def execute_after_capacity_wait(self, context, event: dict) -> dict[str, str] | None:
        if event["status"] == "error":
            raise AirflowException(f"Waiting for capacity in reservation {self.run_spec.reservation} failed: {event['message']}")
        return self._run(context, deadline=event["deadline"])

    def _run(self, context, *, deadline: float | None) -> dict[str, str] | None:
        results = dict(self.results or {})
        remake = VmRemake(self.run_spec, gcp_conn_id=self.gcp_conn_id, ssh_conn_id=self.ssh_conn_id, log=self.log)
        status = remake.status()
        if status == "STOPPING":
            raise AirflowException(f"VM {self.run_spec.vm_name} is STOPPING (going away): the task's retry makes it again")
        if status not in LIVE_STATUSES:
            self._check_remakeable()
            self._remake(remake, status, deadline)
            results |= self._steps_before()
        return self._on_vm(self.step, results)

    def _on_vm(self, step: str, results: dict) -> dict[str, str] | None:
        return run_vm_step(
            step,
            self.run_spec,
            results,
            gcp_conn_id=self.gcp_conn_id,
            ssh_conn_id=self.ssh_conn_id,
            hf_conn_id=self.hf_conn_id,
            log=self.log,
        )

    def _check_remakeable(self) -> None:
        """Fail before paying for a VM that could not do the step: the export reads the final
        checkpoint, which outlives the VM only in the output location."""
        spec = self.run_spec
        if self.step != "export":
            return
        if not spec.durable:
            raise AirflowFailException(
                f"VM {spec.vm_name} is gone and with it the final checkpoint (no output_location): "
                "clear start_training and the tasks after it to train again"
            )
        if not StorageEndpointHook(gcp_conn_id=self.gcp_conn_id).uri_exists(spec.final_commit_marker_uri):
            raise AirflowFailException(
                f"VM {spec.vm_name} is gone and the final checkpoint is not committed in storage "
                f"({spec.final_commit_marker_uri}): "
                "clear start_training and the tasks after it to train again"
            )

    def _remake(self, remake: VmRemake, status: str | None, deadline: float | None) -> None:
        spec = self.run_spec
        reason = f"VM {spec.vm_name} is {'gone' if status is None else status}, and {self.task_id} needs it"
        if deadline is None:
            deadline = time.time() + spec.max_capacity_wait_minutes * 60
        if not remake.machine_free(reason) or not remake.insert(reason):
            if time.time() >= deadline:
                raise AirflowFailException(
                    f"{reason}; no machine was free ({spec.machine_source}, "
                    f"max_capacity_wait_minutes={spec.max_capacity_wait_minutes}): no VM was created"
                )
            trigger = remake.capacity_wait_trigger(
                deadline, poll_seconds=self.capacity_poll_seconds, first_read_seconds=self.capacity_first_read_seconds
            )
            if trigger is None:  # a rehearsal's VM: the cloud refused for capacity; retried
                raise AirflowException(f"{reason}; the cloud refused to make it again for capacity")
            self.log.info("Waiting (deferred, no worker slot) for a free machine: %s", spec.machine_source)
            self.defer(trigger=trigger, method_name="execute_after_capacity_wait")
        self.log.info("Made VM %s again; waiting for its SSH", spec.vm_name)
        self.log.info("VM %s answered SSH after %.1f s", spec.vm_name, remake.wait_for_login())

    def _steps_before(self) -> dict:
        """Run the earlier steps this one needs on the new VM, each timed; return what they reported."""
        reported, _ = run_vm_steps(
            steps_before(self.step, self.run_spec), self.run_spec, {}, what="On the new VM",
            gcp_conn_id=self.gcp_conn_id, ssh_conn_id=self.ssh_conn_id, hf_conn_id=self.hf_conn_id, log=self.log,
        )
        return reported


class SliceScriptOperator(VmScriptOperator):
    """Run `step`'s script on every host of the slice at once (`on_all_hosts`), or on host 0;
    every host must be RUNNING. Returns host 0's results."""

    def __init__(self, *, on_all_hosts: bool, **kwargs):
        super().__init__(**kwargs)
        self.on_all_hosts = on_all_hosts

    def execute(self, context) -> dict[str, str] | None:
        specs = self.host_specs if self.on_all_hosts else self.host_specs[:1]
        check_hosts_running(specs, self.gcp_conn_id)
        results = dict(self.results or {})

        def run(spec: RunSpec):
            return run_vm_step(
                self.step, spec, results, gcp_conn_id=self.gcp_conn_id, ssh_conn_id=self.ssh_conn_id,
                hf_conn_id=self.hf_conn_id, log=HostLog(self.log, spec.vm_name),
            )

        return on_every_host(specs, run, self.step)[0]
