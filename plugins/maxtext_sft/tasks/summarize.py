"""summarize_run: the run summary at the end of every run, whatever its outcome (results/summary.py
builds it from what the tasks left; tasks/phase_timing.py is how they leave their times)."""

from __future__ import annotations

import json
from datetime import datetime, timezone
from typing import Any

from airflow.sdk import TaskGroup, task
from maxtext_sft.cloud.storage import StorageEndpointHook, split_gcs_uri
from maxtext_sft.results.rehearsal import rehearsal_checks
from maxtext_sft.results.outputs import RUN_SUMMARY_NAME
from maxtext_sft.results.summary import (
    PHASE_KEY, REFUSED_FIELDS_KEY, SummaryTasks, backstops, build_summary, recovery_rows, render_text,
)
from maxtext_sft.run.spec import RunSpec
from maxtext_sft.vm.remake import VmRemake


def _tasks_in_order(group: TaskGroup):
    """The group's tasks, each after its upstream tasks (Airflow's own sort: ties in definition
    order), the tasks of nested groups in their place."""
    for node in group.topological_sort():
        if isinstance(node, TaskGroup):
            yield from _tasks_in_order(node)
        else:
            yield node


def phase_order(dag, before: str) -> list[str]:
    """The DAG's task ids in pipeline order, less `before` and every task that waits for it (they
    have not finished when `before` runs: not phases yet)."""
    later = {before} | dag.get_task(before).get_flat_relative_ids(upstream=False)
    return [node.task_id for node in _tasks_in_order(dag.task_group) if node.task_id not in later]


def recovery_ledger(spec: dict | None, gcp_conn_id: str) -> dict[str, dict]:
    """The run's recovery ledger ({object name: its JSON}), empty without an output location."""
    run = RunSpec.from_dict(spec) if spec else None
    if run is None or not run.vm_recoveries_uri:
        return {}
    storage = StorageEndpointHook(gcp_conn_id=gcp_conn_id)
    return {
        name: json.loads(storage.read_text(f"{run.vm_recoveries_uri}/{name}"))
        for name in storage.names_under(run.vm_recoveries_uri)
        if name.endswith(".json")
    }


def gather_summary(context, spec: dict | None, tasks: SummaryTasks, gcp_conn_id: str) -> dict[str, Any]:
    """The summary of this DAG run, from the task states and the XComs of every task before this
    one; `spec` is plan_run's (None when it failed)."""
    ti, dag_run = context["ti"], context["dag_run"]
    order = phase_order(context["dag"], ti.task_id)
    states = ti.get_task_states(dag_id=dag_run.dag_id, run_ids=[dag_run.run_id]).get(dag_run.run_id, {})
    return build_summary(
        dag_id=dag_run.dag_id,
        run_id=dag_run.run_id,
        order=order,
        states=states,
        records={task_id: ti.xcom_pull(task_ids=task_id, key=PHASE_KEY) for task_id in order},
        spec=spec,
        training=ti.xcom_pull(task_ids=tasks.training),
        record=ti.xcom_pull(task_ids=tasks.outputs),
        published=ti.xcom_pull(task_ids=tasks.publish),
        # Without a spec plan_run failed: no VM existed, so no price is needed.
        **_pricing(spec),
        now=datetime.now(timezone.utc),
        tasks=tasks,
        recoveries=recovery_rows(recovery_ledger(spec, gcp_conn_id)),
        # When the VM came to be (after any wait for capacity) and when it started RUNNING (billing
        # starts): the instance create_vm returned. (A slice's create returns its hosts instead:
        # the group's first start stands in.)
        **_instance_times(ti.xcom_pull(task_ids=tasks.create_vm)),
        # What ends the VM if the teardown never does: the instance create_vm returned, and the
        # fields the cloud refused (its XCom).
        backstops=backstops(
            spec, ti.xcom_pull(task_ids=tasks.create_vm), ti.xcom_pull(task_ids=tasks.create_vm, key=REFUSED_FIELDS_KEY)
        ),
        rehearsal_checks=_rehearsal_checks(ti, states, spec, gcp_conn_id) if spec and RunSpec.from_dict(spec).rehearsal else None,
    )


# The Param that prices an hour of the VM on each capacity type (run/params.py).
PRICE_PARAMS = {
    "reservation": "vm_hourly_price_usd",
    "on-demand": "on_demand_hourly_price_usd",
    "spot": "spot_hourly_price_usd",
    "flex-start": "flex_start_hourly_price_usd",
}


def _pricing(spec: dict | None) -> dict[str, Any]:
    """build_summary's prices: what the run's machines cost an hour on its capacity type and, to
    compare, on a reservation and on demand (the Param's price times a slice's hosts; None when
    not given). A rehearsal's CPU VM is on demand at its own vm_hourly_price_usd: no capacity to
    name, nothing to compare."""
    if not spec:
        return {"hourly_price_usd": None}
    run = RunSpec.from_dict(spec)

    def price(capacity: str) -> float | None:
        value = getattr(run, PRICE_PARAMS[capacity])
        return None if value is None else value * run.hosts

    if run.rehearsal:
        return {"hourly_price_usd": price("reservation")}
    return {
        "hourly_price_usd": price(run.capacity),
        "capacity": run.capacity,
        "compared_prices_usd": {capacity: price(capacity) for capacity in ("reservation", "on-demand")},
    }


def _instance_times(created) -> dict[str, str | None]:
    """build_summary's instance_created_at and instance_started_at from create_vm's XCom
    (`Instance.to_dict`, taken once the instance is RUNNING)."""
    instance = created if isinstance(created, dict) else {}
    return {
        "instance_created_at": instance.get("creation_timestamp"),
        "instance_started_at": instance.get("last_start_timestamp"),
    }


def _rehearsal_checks(ti, states: dict, spec: dict, gcp_conn_id: str) -> list[dict[str, str]]:
    try:  # read back: is the instance gone after the delete?
        left = VmRemake(RunSpec.from_dict(spec), gcp_conn_id=gcp_conn_id, ssh_conn_id=None, log=None).status() or ""
    except Exception:  # noqa: BLE001 - the summary never fails; the delete check then says unknown
        left = None
    return rehearsal_checks(
        states=states,
        xcom=lambda task_id, key: ti.xcom_pull(task_ids=task_id, key=key or "return_value"),
        spec=spec,
        instance_left=left,
    )


@task(retries=0, show_return_value_in_logs=False)  # the log gets the text instead
def summarize_run(tasks: dict[str, str], gcp_conn_id: str = "google_cloud_default", **context):
    """Log the run summary (phases, VM lifetime and estimated cost, final step and loss, outputs),
    return it (XCom), and with an output location write run-summary.json beside the run record.
    `tasks` names the tasks it reads (SummaryTasks' fields: task ids).

    Never fails: a summary is worth having even when parts of it are missing, and a teardown
    that fails would only add noise to the run's outcome (check_run_outcome decides that).
    """
    log = context["task"].log
    try:
        parts = SummaryTasks(**tasks)
        spec = context["ti"].xcom_pull(task_ids=parts.plan, key="spec")
        summary = gather_summary(context, spec, parts, gcp_conn_id)
    except Exception:
        log.warning("Could not gather the run summary", exc_info=True)
        return None
    if spec and spec.get("output_location"):
        summary["run_summary"] = f"{RunSpec.from_dict(spec).run_output_dir}/{RUN_SUMMARY_NAME}"
        try:
            bucket, name = split_gcs_uri(summary["run_summary"])
            StorageEndpointHook(gcp_conn_id=gcp_conn_id).upload(
                bucket, name, data=json.dumps(summary, indent=1), mime_type="application/json"
            )
            log.info("Wrote the run summary to %s", summary["run_summary"])
        except Exception as error:
            log.warning("Could not write %s: %s", summary["run_summary"], error)
            summary["run_summary"] = None
    log.info("%s", render_text(summary))
    for warning in summary["warnings"]:
        log.warning("Run summary: %s", warning)
    return summary
