"""Run one step script from include/vm on the run's VM over SSH."""

from __future__ import annotations

import shlex
from collections.abc import Sequence
from typing import Any

import paramiko
from google.api_core.exceptions import NotFound
from googleapiclient.errors import HttpError

from airflow.sdk import BaseOperator
from airflow.sdk.exceptions import AirflowException
from maxtext_sft.hooks.compute import ComputeEngineEndpointHook
from maxtext_sft.hooks.hub import hf_token
from maxtext_sft.hooks.os_login import os_login_username
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
            zone=spec.zone, resource_id=spec.vm_name, project_id=spec.project_id,
            use_internal_ip=not spec.external_address,
        )
    except HttpError as error:
        if error.resp.status == 404:
            raise NotFound(f"instance {spec.vm_name} not found") from error
        raise


class HostKeysNotPublished(RuntimeError):
    """The VM's guest agent has not published its SSH host keys (yet)."""


# Errors that mean "not reachable yet / right now", not "broken".
TRANSIENT_SSH_ERRORS = (OSError, EOFError, paramiko.SSHException)


def vm_ssh_hook(spec: RunSpec, gcp_conn_id: str, ssh_conn_id: str, **kwargs) -> VmSSHHook:
    """An SSH hook to the VM's current address that accepts only the host key the VM published.

    Raises NotFound when the VM is gone, HostKeysNotPublished before its guest agent ran.
    """
    address = vm_address(spec, gcp_conn_id)
    keys = ComputeEngineEndpointHook(gcp_conn_id=gcp_conn_id).get_host_keys(
        resource_id=spec.vm_name, zone=spec.zone, project_id=spec.project_id
    )
    if not keys:
        raise HostKeysNotPublished(f"VM {spec.vm_name} has published no SSH host keys in its guest attributes yet")
    if spec.ssh_via_iap:
        kwargs["host_proxy_cmd"] = iap_tunnel_command(spec)
    hook = VmSSHHook(
        ssh_conn_id=ssh_conn_id,
        remote_host=address,
        host_keys=keys,
        conn_timeout=spec.ssh_connect_timeout_seconds,
        **kwargs,
    )
    if spec.os_login:
        hook.username = os_login_username(gcp_conn_id, spec.ssh_public_key, spec.project_id)
    return hook


def iap_tunnel_command(spec: RunSpec) -> str:
    """gcloud's IAP TCP tunnel to the VM's port 22, as an SSH ProxyCommand (stdin/stdout)."""
    return shlex.join([
        "gcloud", "compute", "start-iap-tunnel", spec.vm_name, "22", "--listen-on-stdin",
        f"--zone={spec.zone}", f"--project={spec.project_id}", "--verbosity=warning",
    ])


def ssh_login_works(spec: RunSpec, gcp_conn_id: str, ssh_conn_id: str, log: Any) -> bool:
    """Whether the VM accepts an SSH login as the pipeline's (non-root) user right now."""
    try:
        hook = vm_ssh_hook(spec, gcp_conn_id, ssh_conn_id, conn_retry_attempts=1)
        with hook.get_conn():
            status, _ = hook.run_command("true", timeout=60, on_line=log.info)
    except (HostKeysNotPublished, *TRANSIENT_SSH_ERRORS) as error:
        log.info("VM %s does not answer SSH yet: %s", spec.vm_name, error)
        return False
    return status == 0


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
        return run_vm_step(
            self.step,
            spec,
            self.results or {},
            gcp_conn_id=self.gcp_conn_id,
            ssh_conn_id=self.ssh_conn_id,
            hf_conn_id=self.hf_conn_id,
            log=self.log,
        )


def run_vm_step(
    step: str, spec: RunSpec, results: dict, *, gcp_conn_id: str, ssh_conn_id: str, hf_conn_id: str, log: Any
) -> dict[str, str] | None:
    """Upload the scripts and run `step`'s script on the run's VM; return what it reported."""
    vm_step = STEPS[step]
    stdin = (hf_token(hf_conn_id) + "\n").encode() if vm_step.needs_hf_token else None
    hook = vm_ssh_hook(spec, gcp_conn_id, ssh_conn_id)
    command = remote_command(step, spec, results)
    reported: list[str] = []

    def on_line(line: str) -> None:
        log.info("%s", line)
        if line.startswith("MAXTEXT_SFT_RESULT "):
            reported.append(line)

    with hook.get_conn():
        hook.upload_scripts(script_files())
        log.info("Running on %s: %s", spec.vm_name, command)
        status, tail = hook.run_command(command, stdin=stdin, timeout=vm_step.timeout_seconds(spec), on_line=on_line)
    if status != 0:
        raise AirflowException(
            f"{vm_step.script} exited with status {status} on {spec.vm_name}; last lines:\n" + "\n".join(tail)
        )
    return parse_results(reported) or None
