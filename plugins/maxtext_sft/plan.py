"""The first task's work: validate the run's inputs and derive its RunSpec, before anything is paid for."""

from __future__ import annotations

from typing import Any

from airflow.providers.ssh.hooks.ssh import SSHHook
from airflow.sdk.exceptions import AirflowFailException
from maxtext_sft.hooks.compute import ComputeEngineEndpointHook
from maxtext_sft.hooks.hub import hf_token
from maxtext_sft.spec import SpecError, build_run_spec


def plan_run(context, *, gcp_conn_id: str, ssh_conn_id: str, hf_conn_id: str) -> dict[str, Any]:
    """Return the spec and the create request's values; fail (without retries) on bad input."""
    dag_run = context["dag_run"]
    try:
        # Only the login and key are needed here; the VM's address exists once the VM does.
        ssh = SSHHook(ssh_conn_id=ssh_conn_id, remote_host="not-connected")
        if ssh.pkey is None:
            raise SpecError(f"SSH connection {ssh_conn_id!r} needs a private_key extra (the VM's login key)")
        hf_token(hf_conn_id)  # present now, or the run stops before a VM exists
        params = dict(context["params"])
        default_project = None
        if not params.get("project_id"):
            default_project = ComputeEngineEndpointHook(gcp_conn_id=gcp_conn_id).project_id
        spec = build_run_spec(
            params,
            dag_id=dag_run.dag_id,
            run_id=dag_run.run_id,
            generation=dag_run.clear_number or 0,
            started=dag_run.logical_date or dag_run.run_after,
            default_project_id=default_project,
            ssh_user=ssh.username or "",
            ssh_public_key=f"{ssh.pkey.get_name()} {ssh.pkey.get_base64()}",
        )
    except (SpecError, ValueError) as error:
        raise AirflowFailException(f"Invalid run configuration: {error}") from error
    return {
        "spec": spec.to_dict(),
        "project_id": spec.project_id,
        "zone": spec.zone,
        "vm_name": spec.vm_name,
        "request_id": spec.request_id,
        "instance_body": spec.instance_body(),
        "lifetime_minutes": spec.max_run_duration_minutes,
        # create_vm's capacity gate
        "reservation": spec.reservation,
        "max_capacity_wait_minutes": spec.max_capacity_wait_minutes,
    }
