"""A tiny DAG shaped like maxtext_sft, no cloud: the phase callbacks and summarize_run on real task
runs (tests/plugins/test_phase_timing.py runs it with dag.test()).

create_vm fails its first try and is retried; wait_for_final_checkpoint is a reschedule-mode
sensor done at its third poke; export_to_hf fails, so collect_outputs and publish_to_hub never
run. The Param `fail_early` fails plan_run instead, before any VM; with `output_location` the
summary is written there. Each task notes when its code ran in the folder the Param `scratch`
names, to compare with what the summary says.
"""

from __future__ import annotations

import json
from datetime import datetime, timedelta, timezone
from pathlib import Path

from airflow.providers.standard.operators.empty import EmptyOperator
from airflow.sdk import DAG, BaseSensorOperator, Param, PokeReturnValue, task
from airflow.sdk.exceptions import AirflowFailException
from maxtext_sft.tasks.outcome import check_run_outcome, record_failure
from maxtext_sft.tasks.phase_timing import note_phase_start, record_phase
from maxtext_sft.results.summary import SummaryTasks
from maxtext_sft.run.spec import build_run_spec
from maxtext_sft.tasks.summarize import summarize_run

HOURLY_PRICE = 36.0


def note(context, what: str) -> None:
    line = {"task": context["ti"].task_id, "what": what, "at": datetime.now(timezone.utc).isoformat()}
    with (Path(context["params"]["scratch"]) / "notes.jsonl").open("a") as notes:
        notes.write(json.dumps(line) + "\n")


def notes(context) -> list[dict]:
    path = Path(context["params"]["scratch"]) / "notes.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


class TrainingSensor(BaseSensorOperator):
    def poke(self, context):
        note(context, "poke")
        pokes = sum(1 for n in notes(context) if n["task"] == self.task_id)
        return PokeReturnValue(is_done=pokes >= 3, xcom_value={"final_step": 3, "final_loss": "1.250"})


with DAG(
    dag_id="summary_probe",
    schedule=None,
    params={
        "scratch": Param("", type="string"),
        "fail_early": Param(False, type="boolean"),
        "output_location": Param(None, type=["null", "string"]),
    },
    default_args={
        "retries": 0,
        "on_execute_callback": note_phase_start,
        "on_success_callback": record_phase,
        "on_failure_callback": [record_failure, record_phase],
    },
) as dag:

    @task(multiple_outputs=True)
    def plan_run(**context):
        if context["params"]["fail_early"]:
            raise AirflowFailException("bad conf")
        spec = build_run_spec(
            {
                "reservation": "r",
                "vm_hourly_price_usd": HOURLY_PRICE,
                "output_location": context["params"]["output_location"],
            },
            dag_id=context["dag_run"].dag_id,
            run_id=context["dag_run"].run_id,
            generation=0,
            started=datetime(2026, 11, 30, tzinfo=timezone.utc),
            default_project_id="my-project",
            ssh_user="maxtext",
            ssh_public_key="ssh-ed25519 AAAA",
        )
        return {"spec": spec.to_dict()}

    # As in the pipeline, a no-op setup; without callbacks the scheduler marks it done itself.
    vm_lease = EmptyOperator(task_id="vm_lease", on_execute_callback=None, on_success_callback=None)

    @task(retries=1, retry_delay=timedelta(0))
    def create_vm(**context):
        note(context, f"try {context['ti'].try_number}")
        if context["ti"].try_number == 1:
            raise RuntimeError("ZONE_RESOURCE_POOL_EXHAUSTED (the retry gets one)")

    wait = TrainingSensor(task_id="wait_for_final_checkpoint", mode="reschedule", poke_interval=1, timeout=120)

    @task
    def export_to_hf(**context):
        note(context, "ran")
        raise AirflowFailException("export failed")

    @task
    def collect_outputs():
        return {"hf_export": "never"}

    @task
    def delete_vm(**context):
        note(context, "ran")

    @task
    def publish_to_hub():
        return None

    run = plan_run()
    deleted = delete_vm().as_teardown(setups=vm_lease)
    collected = collect_outputs()
    published = publish_to_hub()
    run >> vm_lease >> create_vm() >> wait >> export_to_hf() >> collected >> deleted
    collected >> published
    # A teardown without setups: it runs even when the setup never ran (plan_run failed).
    parts = SummaryTasks(
        plan=run.operator.task_id, create_vm="create_vm", delete_vm=deleted.operator.task_id,
        training=wait.task_id, outputs=collected.operator.task_id, publish=published.operator.task_id,
    )
    summary = summarize_run(tasks=vars(parts)).as_teardown()
    [deleted, published] >> summary
    summary >> check_run_outcome(vm_delete_task=parts.delete_vm).as_teardown(setups=vm_lease, on_failure_fail_dagrun=True)
