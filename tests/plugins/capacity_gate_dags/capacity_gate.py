"""create_vm alone, wired as the pipeline wires it, for the capacity gate's tests.

Every value comes from run conf (the tests' reservations and VM names are made per test) through
a plan task, as the pipeline's plan_run hands them over: create_vm's values are XComArgs, so under
the scheduler each try starts on the triggerer (CreateVmStartTrigger); dag.test() runs it on the
worker. This folder is a DAG bundle of its own, added only while those tests run.
"""

from __future__ import annotations

from datetime import timedelta

from airflow.sdk import DAG, task
from maxtext_sft.tasks.compute import CreateVmOperator
from maxtext_sft.tasks.outcome import record_failure

with DAG(
    dag_id="capacity_gate_test",
    schedule=None,
    default_args={"retries": 2, "retry_delay": timedelta(seconds=1), "on_failure_callback": record_failure},
) as dag:

    @task(multiple_outputs=True, retries=0)
    def plan(**context) -> dict:
        return dict(context["dag_run"].conf)

    run = plan()
    CreateVmOperator(
        task_id="create_vm",
        project_id=run["project_id"],
        zone=run["zone"],
        resource_id=run["vm_name"],
        request_id=run["request_id"],
        body=run["body"],
        lifetime_minutes=run["lifetime_minutes"],
        reservation=run["reservation"],
        max_capacity_wait_minutes=run["max_capacity_wait_minutes"],
        capacity_poll_seconds=0.5,
        capacity_first_read_seconds=0.5,
        gcp_conn_id="google_cloud_default",
    )
