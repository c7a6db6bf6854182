"""The first task's work: validate the run's inputs and derive its RunSpec, before anything is paid for."""

from __future__ import annotations

import fnmatch
from typing import Any

from google.api_core.exceptions import GoogleAPICallError

from airflow.sdk.exceptions import AirflowFailException
from maxtext_sft.cloud.compute import ComputeEngineEndpointHook
from maxtext_sft.cloud.hub import HuggingFaceHubHook, hf_token
from maxtext_sft.cloud.storage import StorageEndpointHook
from maxtext_sft.run.snapshots import SnapshotError, dataset_revision_at, files_at, snapshot_moment
from maxtext_sft.run.params import SpecError, refuse_unknown_keys
from maxtext_sft.run.spec import RunSpec, build_run_spec


def plan_run(
    context,
    *,
    gcp_conn_id: str,
    ssh_conn_id: str,
    hf_conn_id: str,
    rehearsal: bool = False,
    tpu_slice: bool = False,
) -> dict[str, Any]:
    """Return the spec and the create requests' values; fail (without retries) on bad input.
    `rehearsal`: the spec of a rehearsal (its Params, its CPU VM); `tpu_slice`: of a multi-host
    slice (its Param, the policy, template and group that make it)."""
    from airflow.providers.ssh.hooks.ssh import SSHHook  # imported when used: DAG files stay cheap to parse (docs/architecture.md)

    dag_run = context["dag_run"]
    try:
        refuse_unknown_keys(dag_run.conf or {}, context["dag"].params)
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
            rehearsal=rehearsal,
            tpu_slice=tpu_slice,
        )
        if spec.bucket_dataset:
            spec = list_bucket_dataset(spec, gcp_conn_id=gcp_conn_id, log=context["task"].log)
        else:
            spec = pin_dataset_snapshot(spec, dag_run, hf_conn_id=hf_conn_id, log=context["task"].log)
    except (SpecError, SnapshotError, ValueError) as error:
        raise AirflowFailException(f"Invalid run configuration: {error}") from error
    return {
        "spec": spec.to_dict(),
        "project_id": spec.project_id,
        "zone": spec.zone,
        "vm_name": spec.vm_name,
        "request_id": spec.request_id,
        "instance_body": spec.instance_body(),
        **(slice_requests(spec) if spec.is_slice else {}),
        "lifetime_minutes": spec.max_run_duration_minutes,
        # create_vm's capacity gate, or its wait through a stockout
        "reservation": spec.consumed_reservation,
        "waits_out_stockouts": spec.waits_out_stockouts,
        "queue_minutes": spec.flex_start_valid_minutes if spec.queued_insert else None,
        "max_capacity_wait_minutes": spec.max_capacity_wait_minutes,
    }


def slice_requests(spec: RunSpec) -> dict[str, Any]:
    """The slice's create requests, for the provision tasks' templated fields."""
    return {
        "region": spec.region,
        "hosts": spec.hosts,
        "ready_timeout_seconds": spec.ssh_ready_timeout_seconds,
        "policy_name": spec.policy_name,
        "template_name": spec.template_name,
        "group_name": spec.group_name,
        "workload_policy_body": spec.workload_policy_body(),
        "instance_template_body": spec.instance_template_body(),
        "group_body": spec.group_body(),
    }


def pin_dataset_snapshot(spec: RunSpec, dag_run, *, hf_conn_id: str, log) -> RunSpec:
    """The spec with a Hub dataset pinned to one commit (the one the Param's revision names now,
    else the newest at the run's data interval end) and the files it will read at that commit.

    A dataset, revision or token the Hub refuses leaves the spec as it is: preflight then names
    what is wrong, with the other checks' findings.
    """
    from huggingface_hub.errors import HfHubHTTPError  # imported when used: DAG files stay cheap to parse (docs/architecture.md)

    if not spec.hub_dataset:
        return spec
    api = HuggingFaceHubHook(hf_conn_id=hf_conn_id).get_conn()
    moment = snapshot_moment(dag_run.data_interval_end, dag_run.run_after)
    try:
        if spec.dataset_revision:  # a branch or tag moves: pin the commit it names now
            revision = api.repo_info(spec.dataset_name, repo_type="dataset", revision=spec.dataset_revision).sha
        else:
            revision = dataset_revision_at(api, spec.dataset_name, moment)
        files = files_at(api, spec.dataset_name, revision, spec.train_files_pattern)
    except HfHubHTTPError as error:
        status = error.response.status_code if error.response is not None else None
        if status is None or status >= 500:
            raise  # the Hub is unwell: the task's retries are for this
        log.warning("Dataset snapshot not pinned (preflight will say why): HTTP %s", status)
        return spec
    how = f"Param dataset_revision {spec.dataset_revision}" if spec.dataset_revision else f"newest at {moment.isoformat()}"
    log.info("Dataset %s pinned to commit %s (%s): %s", spec.dataset_name, revision, how, files)
    return spec.with_values(dataset_revision=revision, dataset_files=tuple(files))


def list_bucket_dataset(spec: RunSpec, *, gcp_conn_id: str, log) -> RunSpec:
    """The spec with the files of a dataset folder in a bucket (its path already names the run's
    date, if it is templated). A bucket that cannot be listed leaves no files: preflight says so."""
    try:
        names = StorageEndpointHook(gcp_conn_id=gcp_conn_id).names_under(spec.dataset_name)
    except GoogleAPICallError as error:
        if error.code is not None and error.code >= 500:
            raise  # storage is unwell: the task's retries are for this
        log.warning("Dataset folder %s not listed (preflight will say why): %s", spec.dataset_name, error.code)
        return spec
    files = sorted(name for name in names if fnmatch.fnmatchcase(name, spec.train_files_pattern))
    log.info("Dataset %s: %s", spec.dataset_name, files)
    return spec.with_values(dataset_files=tuple(files))
