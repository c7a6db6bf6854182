"""The bake, as a DAG: MaxText installed once on a cheap CPU VM, kept as an image in a family.

  0. plan: validate the Params and connections, check the source image family exists and
     whether the target family already holds this MaxText version (then: say so, skip all)
  1. create an on-demand CPU VM from the source image (terminates by DELETE at its lifetime)
  2. wait for SSH as the pipeline's VM user
  3. install MaxText (the fine-tune's own install_maxtext step)
  4. stop the VM (its boot disk stays)
  5. create the image from the boot disk, in the family
  6. delete the VM, whatever happened; the run fails if any step failed
"""

from __future__ import annotations

from typing import Any

from airflow.providers.standard.operators.empty import EmptyOperator
from airflow.sdk import DAG, Param, task
from airflow.sdk.exceptions import AirflowFailException
from maxtext_sft.run.bake import BAKE_PARAMS, BakeSpec, baked_image, build_bake_spec
from maxtext_sft.builders.settings import GCP_CONN_ID, HF_CONN_ID, SSH_CONN_ID, give_params_after_tasks, task_defaults
from maxtext_sft.cloud.compute import ComputeEngineEndpointHook
from maxtext_sft.tasks.compute import CreateImageOperator, CreateVmOperator, DeleteVmOperator, StopVmOperator
from maxtext_sft.tasks.vm_script import VmScriptOperator
from maxtext_sft.tasks.outcome import check_bake_outcome, record_failure
from maxtext_sft.tasks.vm_sensors import VmSshReadySensor
from maxtext_sft.run.dag_params import airflow_params
from maxtext_sft.run.params import SpecError


def bake_params() -> dict[str, Param]:
    return airflow_params(BAKE_PARAMS)


def plan_bake(context, *, gcp_conn_id: str, ssh_conn_id: str) -> dict[str, Any]:
    """The bake's spec and request bodies; fails (no retries) on bad input, before any VM."""
    from airflow.providers.ssh.hooks.ssh import SSHHook  # paramiko: not at parse time

    dag_run = context["dag_run"]
    log = context["task"].log
    try:
        ssh = SSHHook(ssh_conn_id=ssh_conn_id, remote_host="not-connected")
        if ssh.pkey is None:
            raise SpecError(f"SSH connection {ssh_conn_id!r} needs a private_key extra (the VM's login key)")
        params = dict(context["params"])
        hook = ComputeEngineEndpointHook(gcp_conn_id=gcp_conn_id)
        spec = build_bake_spec(
            params,
            dag_id=dag_run.dag_id,
            run_id=dag_run.run_id,
            started=dag_run.logical_date or dag_run.run_after,
            default_project_id=None if params.get("project_id") else hook.project_id,
            ssh_user=ssh.username or "",
            ssh_public_key=f"{ssh.pkey.get_name()} {ssh.pkey.get_base64()}",
        )
    except (SpecError, ValueError) as error:
        raise AirflowFailException(f"Invalid bake configuration: {error}") from error
    if hook.get_image_from_family(family=spec.source_image_family, project_id=spec.source_image_project) is None:
        raise AirflowFailException(
            f"Source image family {spec.source_image_project}/{spec.source_image_family} has no image: no VM was created"
        )
    existing = baked_image(hook.list_images(project_id=spec.project_id), spec)
    if existing is None:
        taken = hook.get_image(name=spec.image_name, project_id=spec.project_id)
        if taken is not None and not str(taken.get("sourceDisk", "")).endswith(spec.boot_disk):
            raise AirflowFailException(f"Param 'image_name': image {spec.image_name} already exists: no VM was created")
    log.info(
        "Runs find this bake's venv with image_project=%s, image_family=%s, SSH login %s, work_dir %s",
        spec.project_id, spec.image_family, spec.ssh_user, spec.work_dir,
    )
    return {
        "spec": spec.to_dict(),
        "vm_spec": spec.vm_step_spec,
        "project_id": spec.project_id,
        "zone": spec.zone,
        "vm_name": spec.vm_name,
        "request_id": spec.vm_run_spec.request_id,
        "instance_body": spec.instance_body(),
        "lifetime_minutes": spec.max_run_duration_minutes,
        "image_body": spec.image_body(),
        "baked_image": existing["name"] if existing else None,
    }


def bake_image_dag(dag_id: str, *, doc_md: str | None = None) -> DAG:
    with DAG(
        dag_id=dag_id,
        description="Install MaxText once into an image family; runs on that family skip the install",
        schedule=None,
        tags=["maxtext", "image"],
        default_args=task_defaults(owner="ml-platform", on_failure_callback=record_failure),  # check_bake_outcome names the cause
        doc_md=doc_md or __doc__,
    ) as dag:
        _add_bake_tasks()
    give_params_after_tasks(dag, bake_params())
    return dag


def _add_bake_tasks() -> None:
    @task(multiple_outputs=True)
    def plan(**context):
        """Validate everything and look at the families; fail before any VM exists."""
        return plan_bake(context, gcp_conn_id=GCP_CONN_ID, ssh_conn_id=SSH_CONN_ID)

    planned = plan()

    @task.short_circuit
    def needs_bake(spec: dict, baked: str | None, **context):
        """Skip everything when the family already holds this version (a second bake is a no-op)."""
        if baked:
            bake = BakeSpec.from_dict(spec)
            context["task"].log.info(
                "Image family %s/%s already has READY image %s with MaxText %s for user %s in %s: nothing to bake",
                bake.project_id, bake.image_family, baked, bake.maxtext_version, bake.ssh_user, bake.work_dir,
            )
            return False
        return True

    go = needs_bake(planned["spec"], planned["baked_image"])
    vm_lease = EmptyOperator(task_id="vm_lease", on_execute_callback=None, on_success_callback=None)
    where = {"project_id": planned["project_id"], "zone": planned["zone"], "gcp_conn_id": GCP_CONN_ID}
    create_vm = CreateVmOperator(
        task_id="create_vm",
        resource_id=planned["vm_name"],
        request_id=planned["request_id"],
        body=planned["instance_body"],
        lifetime_minutes=planned["lifetime_minutes"],
        retry_exponential_backoff=True,
        **where,
    )
    connections = {"gcp_conn_id": GCP_CONN_ID, "ssh_conn_id": SSH_CONN_ID}
    wait_for_ssh = VmSshReadySensor(
        task_id="wait_for_ssh", spec=planned["vm_spec"], poke_interval=5, timeout=600, **connections
    )
    install_maxtext = VmScriptOperator(
        task_id="install_maxtext", step="install", spec=planned["vm_spec"], hf_conn_id=HF_CONN_ID, **connections
    )
    stop_vm = StopVmOperator(task_id="stop_vm", resource_id=planned["vm_name"], **where)
    create_image = CreateImageOperator(
        task_id="create_image", project_id=planned["project_id"], body=planned["image_body"], gcp_conn_id=GCP_CONN_ID
    )
    delete_vm = DeleteVmOperator(
        task_id="delete_vm", resource_id=planned["vm_name"], retries=5, **where
    ).as_teardown(setups=vm_lease)
    outcome = check_bake_outcome(vm_delete_task=delete_vm.task_id).as_teardown(
        setups=vm_lease, on_failure_fail_dagrun=True
    )

    go >> vm_lease >> create_vm >> wait_for_ssh >> install_maxtext >> stop_vm >> create_image >> delete_vm >> outcome
