"""Run one step script from include/vm on the run's VM over SSH."""

from __future__ import annotations

from collections.abc import Sequence

from google.api_core.exceptions import NotFound
from googleapiclient.errors import HttpError

from airflow.sdk import BaseOperator
from airflow.sdk.exceptions import AirflowException
from maxtext_sft.hooks.compute import ComputeEngineEndpointHook
from maxtext_sft.hooks.hub import hf_token
from maxtext_sft.hooks.vm_ssh import VmSSHHook
from maxtext_sft.spec import RunSpec
from maxtext_sft.vm_steps import STEPS, parse_results, remote_command, script_files


def vm_address(spec: RunSpec, gcp_conn_id: str) -> str:
    """The VM's address, asked from the Compute API each time (a recreated VM may have a new one).

    Raises google.api_core's NotFound when the instance is gone (the hook's discovery client
    reports that as an HttpError 404).
    """
    hook = ComputeEngineEndpointHook(gcp_conn_id=gcp_conn_id)
    try:
        return hook.get_instance_address(
            zone=spec.zone, resource_id=spec.vm_name, project_id=spec.project_id, use_internal_ip=spec.use_internal_ip
        )
    except HttpError as error:
        if error.resp.status == 404:
            raise NotFound(f"instance {spec.vm_name} not found") from error
        raise


class VmScriptOperator(BaseOperator):
    """Upload the step scripts and run `step`'s script; the HF token goes on stdin, never in argv.

    The script's output streams into the task log as it comes. What the script reports with
    `report_result` (paths, never secrets) is the task's XCom; `results` passes an earlier step's
    XCom in (e.g. the converted checkpoint's path to the training step).
    """

    template_fields: Sequence[str] = ("spec", "results")
    ui_color = "#e8f4ea"

    def __init__(
        self, *, step: str, spec, gcp_conn_id: str, ssh_conn_id: str, hf_conn_id: str, results=None, **kwargs
    ):
        super().__init__(**kwargs)
        if step not in STEPS:
            raise ValueError(f"unknown VM step {step!r}; known: {sorted(STEPS)}")
        self.step = step
        self.spec = spec
        self.results = results
        self.gcp_conn_id = gcp_conn_id
        self.ssh_conn_id = ssh_conn_id
        self.hf_conn_id = hf_conn_id

    def execute(self, context) -> dict[str, str] | None:
        spec = RunSpec.from_dict(self.spec)
        vm_step = STEPS[self.step]
        stdin = (hf_token(self.hf_conn_id) + "\n").encode() if vm_step.needs_hf_token else None
        hook = VmSSHHook(
            ssh_conn_id=self.ssh_conn_id,
            remote_host=vm_address(spec, self.gcp_conn_id),
            conn_timeout=spec.ssh_connect_timeout_seconds,
        )
        command = remote_command(self.step, spec, self.results or {})
        reported: list[str] = []

        def on_line(line: str) -> None:
            self.log.info("%s", line)
            if line.startswith("MAXTEXT_SFT_RESULT "):
                reported.append(line)

        with hook.get_conn():
            hook.upload_scripts(script_files())
            self.log.info("Running on %s: %s", spec.vm_name, command)
            status, tail = hook.run_command(command, stdin=stdin, timeout=vm_step.timeout_seconds(spec), on_line=on_line)
        if status != 0:
            raise AirflowException(
                f"{vm_step.script} exited with status {status} on {spec.vm_name}; last lines:\n" + "\n".join(tail)
            )
        return parse_results(reported) or None
