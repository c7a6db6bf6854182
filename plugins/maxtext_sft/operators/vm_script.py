"""Run one step script from include/vm on the run's VM over SSH."""

from __future__ import annotations

from collections.abc import Sequence

from maxtext_sft.run_task import RunTaskOperator
from maxtext_sft.vm_access import run_vm_step
from maxtext_sft.vm_steps import STEPS


class VmScriptOperator(RunTaskOperator):
    """Upload the step scripts and run `step`'s script; the HF token goes on stdin, never in argv.

    The script's output streams into the task log as it comes. What the script reports with
    `report_result` (paths, never secrets) is the task's XCom; `results` passes an earlier step's
    XCom in (e.g. the converted checkpoint's path to the training step).
    """

    template_fields: Sequence[str] = ("spec", "results")
    ui_color = "#e8f4ea"

    def __init__(self, *, step: str, ssh_conn_id: str, hf_conn_id: str, results=None, **kwargs):
        super().__init__(ssh_conn_id=ssh_conn_id, hf_conn_id=hf_conn_id, **kwargs)
        if step not in STEPS:
            raise ValueError(f"unknown VM step {step!r}; known: {sorted(STEPS)}")
        self.step = step
        self.results = results

    def execute(self, context) -> dict[str, str] | None:
        return run_vm_step(
            self.step,
            self.run_spec,
            self.results or {},
            gcp_conn_id=self.gcp_conn_id,
            ssh_conn_id=self.ssh_conn_id,
            hf_conn_id=self.hf_conn_id,
            log=self.log,
        )
