"""create_vm alone, wired as the pipeline wires it, for the capacity gate's tests.

Every value comes from run conf (the tests' reservations and VM names are made per test); this
folder is a DAG bundle of its own, added only while those tests run.
"""

from __future__ import annotations

from datetime import timedelta

from airflow.sdk import DAG
from maxtext_sft.operators.compute import CreateVmOperator
from maxtext_sft.outcome import record_failure

with DAG(
    dag_id="capacity_gate_test",
    schedule=None,
    render_template_as_native_obj=True,  # the body stays a dict, the wait a number
    default_args={"retries": 2, "retry_delay": timedelta(seconds=1), "on_failure_callback": record_failure},
) as dag:
    CreateVmOperator(
        task_id="create_vm",
        project_id="{{ dag_run.conf['project_id'] }}",
        zone="{{ dag_run.conf['zone'] }}",
        resource_id="{{ dag_run.conf['vm_name'] }}",
        request_id="{{ dag_run.conf['request_id'] }}",
        body="{{ dag_run.conf['body'] }}",
        lifetime_minutes="{{ dag_run.conf['lifetime_minutes'] }}",
        reservation="{{ dag_run.conf['reservation'] }}",
        max_capacity_wait_minutes="{{ dag_run.conf['max_capacity_wait_minutes'] }}",
        capacity_poll_seconds=0.5,
        capacity_first_read_seconds=0.5,
        gcp_conn_id="google_cloud_default",
    )
