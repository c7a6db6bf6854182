"""The fine-tune, as a DAG: the tutorial's runbook, step by step, for every DAG that runs it.

`fine_tune_dag` builds the task graph; dags/maxtext_sft.py (the manual DAG, run conf) and each
declared job (include/jobs/*.yaml, one loader in dags/ each) call it with their own schedule
and Param defaults, so every DAG runs the same steps:
  0. plan the run (validate Params, pin the dataset snapshot) and check the token, model,
     dataset, reservation and output location (nothing is paid for yet)
  1. create the TPU VM (ct6e-standard-8t, RESERVATION_BOUND, terminates by DELETE)
  2. install MaxText on it
  3. convert the Hugging Face checkpoint to MaxText format
  4. run SFT (detached; a sensor waits for the final checkpoint)
  5. convert the result back to Hugging Face format; keep it (output_location, or the worker)
  6. delete the VM, whatever happened before; publish to the Hub if asked
  7. summarize the run (durations, VM-hours and cost, loss), whatever happened
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import datetime
from typing import Any

from airflow.providers.standard.operators.empty import EmptyOperator
from airflow.sdk import DAG, Param, TaskGroup, chain, task
from maxtext_sft.builders.settings import (
    GCP_CONN_ID,
    HF_CONN_ID,
    SSH_CONN_ID,
    capacity_reads,
    give_params_after_tasks,
    ssh_wait_deferrable,
    task_defaults,
    training_wait_deferrable,
)
from maxtext_sft.results.fine_tunes import FINE_TUNE_TAG
from maxtext_sft.results.lineage import TUNED_MODEL
from maxtext_sft.tasks.compute import CreateVmOperator, DeleteVmOperator
from maxtext_sft.tasks.outputs import CollectOutputsOperator, PublishToHubOperator
from maxtext_sft.tasks.slice import (
    CreateInstanceTemplateOperator,
    CreateSliceOperator,
    CreateWorkloadPolicyOperator,
    DeleteInstanceTemplateOperator,
    DeleteSliceOperator,
    DeleteWorkloadPolicyOperator,
)
from maxtext_sft.tasks.vm_script import SliceScriptOperator, VmScriptOperator
from maxtext_sft.tasks.outcome import check_run_outcome, record_failure
from maxtext_sft.tasks.phase_timing import note_phase_start, record_phase
from maxtext_sft.tasks.plan import plan_run as plan
from maxtext_sft.tasks.preflight import run_preflight
from maxtext_sft.results.summary import SummaryTasks
from maxtext_sft.tasks.vm_sensors import (
    SliceSshReadySensor,
    SliceTrainingSensor,
    TrainingCheckpointSensor,
    VmSshReadySensor,
)
from maxtext_sft.run.spec import RunSpec
from maxtext_sft.tasks.summarize import summarize_run


def fine_tune_dag(
    dag_id: str,
    *,
    params: dict[str, Param],
    schedule: Any = None,
    start_date: datetime | None = None,
    end_date: datetime | None = None,
    catchup: bool = False,
    max_active_runs: int = 16,
    max_consecutive_failed_dag_runs: int = 0,
    is_paused_upon_creation: bool | None = None,
    description: str = "MaxText SFT on a TPU VM (reservation, flex-start, Spot or on demand), deleted whatever happens",
    tags: list[str] | None = None,
    owner: str = "ml-platform",
    on_failure_callback: Callable | None = None,
    doc_md: str | None = None,
    rehearsal: bool = False,
    tpu_slice: bool = False,
) -> DAG:
    """A DAG that runs the fine-tune with these Param defaults on this schedule.

    `rehearsal`: the same tasks on a cheap on-demand CPU VM (rehearsal_machine_type, no
    reservation), at toy size (the kit prepare_rehearsal makes on the VM), plus the checks from
    the VM (check_vm_access); its run summary lists what each check proved.

    `tpu_slice`: the same steps on a multi-host slice (the tpu_slice Param: a workload policy, an
    instance template and a managed instance group of hosts), each step on every host or on host 0;
    the teardown deletes the group, the template and the policy."""
    with DAG(
        dag_id=dag_id,
        description=description,
        schedule=schedule,
        start_date=start_date,
        end_date=end_date,
        catchup=catchup,
        max_active_runs=max_active_runs,
        max_consecutive_failed_dag_runs=max_consecutive_failed_dag_runs,  # 0: never pauses itself
        is_paused_upon_creation=is_paused_upon_creation,
        tags=[*(tags or ["maxtext", "sft", "tpu"]), FINE_TUNE_TAG],  # the Fine-tunes page finds its DAGs by it
        on_failure_callback=on_failure_callback,  # the run failed: tell its owners
        # Each task's first start, end and tries, for the run summary (maxtext_sft.tasks.phase_timing);
        # a failed task's error, for check_run_outcome to name the cause.
        default_args=task_defaults(
            owner=owner,
            on_execute_callback=note_phase_start,
            on_success_callback=record_phase,
            on_failure_callback=[record_failure, record_phase],
        ),
        doc_md=doc_md or __doc__,
    ) as dag:
        _add_fine_tune_tasks(rehearsal, tpu_slice)
    give_params_after_tasks(dag, params)
    return dag


# The runbook's phases, one task group each (the graph's table of contents). Task ids stay
# unprefixed: run summaries, logs and the clearing table (docs/reliability.md) name tasks as before.
PHASES = {
    "plan": "Validate the Params, pin the dataset, check what a run needs before paying",
    "provision": "Create the VM, reach it over SSH, install MaxText",
    "train": "Convert the base checkpoint, train, wait for the final checkpoint",
    "export_and_publish": "Convert back to Hugging Face format, record the outputs, publish",
    "clean_up": "Delete the VM, summarize the run, decide its outcome",
}


def _add_fine_tune_tasks(rehearsal: bool, tpu_slice: bool = False) -> None:
    phase = {name: TaskGroup(name, tooltip=tooltip, prefix_group_id=False) for name, tooltip in PHASES.items()}

    @task(multiple_outputs=True)
    def plan_run(**context):
        """Validate Params and connections; derive names and paths; pin the dataset snapshot.
        Bad input fails at once (no retries); nothing is paid for yet."""
        return plan(
            context, gcp_conn_id=GCP_CONN_ID, ssh_conn_id=SSH_CONN_ID, hf_conn_id=HF_CONN_ID, rehearsal=rehearsal,
            tpu_slice=tpu_slice,
        )

    run = plan_run.override(task_group=phase["plan"])()

    @task
    def preflight(spec: dict, **context):
        """Check what would otherwise fail on the paid-for VM: token and model access, the dataset
        snapshot and its files, the reservation's machine type and free capacity, the output location."""
        return run_preflight(
            RunSpec.from_dict(spec), gcp_conn_id=GCP_CONN_ID, hf_conn_id=HF_CONN_ID, log=context["task"].log,
            capacity_gate=True,  # a full reservation is waited for by create_vm, not a failure
        )

    checked = preflight.override(task_group=phase["plan"])(run["spec"])
    vm_connections = {"gcp_conn_id": GCP_CONN_ID, "ssh_conn_id": SSH_CONN_ID}
    # The steps on the VM make it again when it is gone (a cleared task, a VM lost between two
    # tasks), behind the capacity gate as create_vm.
    step_connections = {**vm_connections, "hf_conn_id": HF_CONN_ID, **capacity_reads()}
    # wait_for_ssh: deferred to the triggerer while a host does not answer, holding no worker slot
    # ([maxtext_sft] ssh_wait_deferrable); its events wait out the deferral's report as the gate's.
    ssh_wait = {
        "deferrable": ssh_wait_deferrable(),
        "capacity_first_read_seconds": capacity_reads()["capacity_first_read_seconds"],
    }

    # A no-op setup whose teardown is the delete: unlike a create-as-setup, it lets the delete
    # run even when the create fails after the API accepted it, or a user marks the run failed.
    # (No callbacks: an EmptyOperator with callbacks is sent to a worker instead of being marked done.)
    vm_lease = EmptyOperator(
        task_id="vm_lease", on_execute_callback=None, on_success_callback=None, task_group=phase["provision"]
    )

    if tpu_slice:
        # 1. The slice: its workload policy and instance template, then the group of hosts, once
        # the reservation has a machine free for every host (deferred while it has not); then
        # one deferred wait until every host is RUNNING. Its XCom is the hosts, in worker order.
        create_workload_policy = CreateWorkloadPolicyOperator(
            task_id="create_workload_policy", task_group=phase["provision"], project_id=run["project_id"],
            region=run["region"], body=run["workload_policy_body"], gcp_conn_id=GCP_CONN_ID,
        )
        create_instance_template = CreateInstanceTemplateOperator(
            task_id="create_instance_template", task_group=phase["provision"], project_id=run["project_id"],
            body=run["instance_template_body"], lifetime_minutes=run["lifetime_minutes"], gcp_conn_id=GCP_CONN_ID,
        )
        create_vm = CreateSliceOperator(
            task_id="create_slice",
            task_group=phase["provision"],
            project_id=run["project_id"],
            zone=run["zone"],
            body=run["group_body"],
            hosts=run["hosts"],
            reservation=run["reservation"],
            max_capacity_wait_minutes=run["max_capacity_wait_minutes"],
            ready_timeout_seconds=run["ready_timeout_seconds"],
            **capacity_reads(),
            gcp_conn_id=GCP_CONN_ID,
            retry_exponential_backoff=True,
        )
        creates = [create_workload_policy, create_instance_template, create_vm]
        # Every later step knows the hosts from create_slice; one-host steps run on host 0.
        hosts = {"hosts": create_vm.output}
        wait_for_ssh = SliceSshReadySensor(
            task_id="wait_for_ssh", spec=run["spec"], poke_interval=5, timeout=3900, task_group=phase["provision"],
            **hosts, **ssh_wait, **vm_connections,
        )

        def vm_step(task_id: str, step: str, group: str, *, on_all_hosts: bool, **more) -> VmScriptOperator:
            return SliceScriptOperator(
                task_id=task_id, step=step, spec=run["spec"], task_group=phase[group], on_all_hosts=on_all_hosts,
                **hosts, **step_connections, **more,
            )
    else:
        # 1. Create the VM, once the reservation has a machine free: across every DAG that uses it,
        # no more VMs than it holds. Waiting (and an insert the cloud refuses for capacity, or a
        # stockout when there is no reservation) defers the task to the triggerer, holding no
        # worker slot, up to max_capacity_wait_minutes.
        create_vm = CreateVmOperator(
            task_id="create_vm",
            task_group=phase["provision"],
            project_id=run["project_id"],
            zone=run["zone"],
            resource_id=run["vm_name"],
            request_id=run["request_id"],
            body=run["instance_body"],
            lifetime_minutes=run["lifetime_minutes"],
            reservation=run["reservation"],
            waits_out_stockouts=run["waits_out_stockouts"],
            queue_minutes=run["queue_minutes"],
            max_capacity_wait_minutes=run["max_capacity_wait_minutes"],
            **capacity_reads(),
            gcp_conn_id=GCP_CONN_ID,
            retry_exponential_backoff=True,  # 5xx errors clear up over minutes
        )
        # Bounded by ssh_ready_timeout_seconds (the sensor's own clock, naming the cause); the
        # sensor's timeout only backs it up.
        wait_for_ssh = VmSshReadySensor(
            task_id="wait_for_ssh", spec=run["spec"], poke_interval=5, timeout=3900, task_group=phase["provision"],
            **ssh_wait, **vm_connections,
        )
        creates = [create_vm]
        hosts = {}

        def vm_step(task_id: str, step: str, group: str, *, on_all_hosts: bool, **more) -> VmScriptOperator:
            return VmScriptOperator(
                task_id=task_id, step=step, spec=run["spec"], task_group=phase[group], **step_connections, **more
            )

    # 2. Install MaxText (on every host).
    install_maxtext = vm_step("install_maxtext", "install", "provision", on_all_hosts=True)

    # The rehearsal: what the VM itself reaches (bucket, Hub), and the toy inputs it trains on.
    if rehearsal:
        check_vm_access = vm_step("check_vm_access", "check_vm_access", "provision", on_all_hosts=False)
        prepare_rehearsal = vm_step("prepare_rehearsal", "prepare_rehearsal", "provision", on_all_hosts=False)
        rehearsal_steps = [check_vm_access, prepare_rehearsal]
    else:
        rehearsal_steps = []

    # 3. Convert Hugging Face -> MaxText (on host 0: the output location holds it for all).
    convert_checkpoint = vm_step("convert_checkpoint", "convert", "train", on_all_hosts=False)

    # 4. SFT: started detached (on every host: one JAX process each), then watched until the
    # final checkpoint. The converted checkpoint's path (maybe another run's) goes in.
    start_training = vm_step(
        "start_training", "start_training", "train", on_all_hosts=True, results=convert_checkpoint.output
    )
    # A VM lost mid-training is recreated here and the training resumed (max_vm_recoveries); a
    # slice's lost host fails the run (vm/slice_hosts.py). Deferred to the triggerer between its checks
    # ([maxtext_sft] training_wait_deferrable; false: reschedule mode).
    wait_for_final_checkpoint = (SliceTrainingSensor if tpu_slice else TrainingCheckpointSensor)(
        task_id="wait_for_final_checkpoint", spec=run["spec"], task_group=phase["train"], **hosts, **step_connections,
        deferrable=training_wait_deferrable(),
    )

    # 5. Convert MaxText -> Hugging Face (on host 0); the model card and the run record go next to it.
    export_to_hf = vm_step("export_to_hf", "export", "export_and_publish", on_all_hosts=False)
    collect_outputs = CollectOutputsOperator(
        task_id="collect_outputs",
        task_group=phase["export_and_publish"],
        spec=run["spec"],
        training=wait_for_final_checkpoint.output,
        base_checkpoint=convert_checkpoint.output,
        export=export_to_hf.output,
        # A new model: DAGs scheduled on this Asset start (not on a rehearsal's toy).
        outlets=[] if rehearsal else [TUNED_MODEL],
        **hosts,
        **vm_connections,
        hf_conn_id=HF_CONN_ID,  # the base model's config.json, to check the export's against
    )

    # 6. Delete the VM in every outcome; a slice's group (with its hosts), then its template and
    # policy, which Compute Engine keeps while a group uses them.
    if tpu_slice:
        delete_vm = DeleteSliceOperator(
            task_id="delete_slice", task_group=phase["clean_up"], project_id=run["project_id"], zone=run["zone"],
            resource_id=run["group_name"], gcp_conn_id=GCP_CONN_ID, retries=5,
        ).as_teardown(setups=vm_lease)
        delete_instance_template = DeleteInstanceTemplateOperator(
            task_id="delete_instance_template", task_group=phase["clean_up"], project_id=run["project_id"],
            resource_id=run["template_name"], gcp_conn_id=GCP_CONN_ID, retries=5,
        ).as_teardown(setups=vm_lease)
        delete_workload_policy = DeleteWorkloadPolicyOperator(
            task_id="delete_workload_policy", task_group=phase["clean_up"], project_id=run["project_id"],
            region=run["region"], name=run["policy_name"], gcp_conn_id=GCP_CONN_ID, retries=5,
        ).as_teardown(setups=vm_lease)
        deletes = [delete_vm, delete_instance_template, delete_workload_policy]
    else:
        delete_vm = DeleteVmOperator(
            task_id="delete_vm",
            task_group=phase["clean_up"],
            project_id=run["project_id"],
            zone=run["zone"],
            resource_id=run["vm_name"],
            gcp_conn_id=GCP_CONN_ID,
            retries=5,
        ).as_teardown(setups=vm_lease)
        deletes = [delete_vm]

    # Publishing reads the export from storage (or the worker), so it need not hold the VM.
    publish_to_hub = PublishToHubOperator(
        task_id="publish_to_hub",
        task_group=phase["export_and_publish"],
        spec=run["spec"],
        record=collect_outputs.output,
        gcp_conn_id=GCP_CONN_ID,
        hf_conn_id=HF_CONN_ID,
    )

    chain(
        run,
        checked,
        vm_lease,
        *creates,
        wait_for_ssh,
        install_maxtext,
        *rehearsal_steps,
        convert_checkpoint,
        start_training,
        wait_for_final_checkpoint,
        export_to_hf,
        collect_outputs,
        *deletes,
    )
    collect_outputs >> publish_to_hub

    # The run summary (phases, VM lifetime and cost, final loss, outputs), whatever happened: a
    # teardown without setups, so that it runs also when the run failed before the VM existed.
    summary = summarize_run.override(task_group=phase["clean_up"])(
        tasks=vars(SummaryTasks(
            plan=run.operator.task_id,
            create_vm=create_vm.task_id,
            delete_vm=delete_vm.task_id,
            training=wait_for_final_checkpoint.task_id,
            outputs=collect_outputs.task_id,
            publish=publish_to_hub.task_id,
        )),
        gcp_conn_id=GCP_CONN_ID,
    ).as_teardown()

    # Airflow takes a run's state from its leaf tasks, and a successful delete would otherwise
    # decide it. This last teardown runs in every outcome (so also when a user marks the run
    # failed, which skips the tasks that had not run) and fails the run unless every task
    # succeeded, the delete included.
    # No setups, as the summary: it runs also when the run failed before the VM lease (plan_run or
    # preflight refused it), so that the run's own error names that cause too.
    outcome = check_run_outcome.override(task_group=phase["clean_up"])(vm_delete_task=delete_vm.task_id).as_teardown(
        on_failure_fail_dagrun=True
    )
    [deletes[-1], publish_to_hub] >> summary >> outcome
    [deletes[-1], publish_to_hub] >> outcome
