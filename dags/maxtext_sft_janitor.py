"""Janitor: delete MaxText SFT VMs whose DAG run is over, or whose lifetime has passed.

A backstop for the pipeline's own teardown (see plugins/maxtext_sft/tasks/janitor.py, which is also a
command for cron or Cloud Scheduler while Airflow is down). Only instances labelled
`managed-by=airflow-maxtext-sft` are ever looked at; every deletion is logged with its reason,
and told to the owners of a declared job (its `notify` connection) whose VM it was.
"""

from __future__ import annotations

import logging
from datetime import timedelta

import airflow.providers.google.cloud.hooks.compute  # noqa: F401 - the DAG processor imports these once,
import airflow.providers.google.cloud.hooks.gcs  # noqa: F401 - before it forks each parse
from airflow.sdk import DAG, Param, conf, task
from maxtext_sft.cloud.compute import ComputeEngineEndpointHook
from maxtext_sft.tasks.janitor import UNKNOWN, sweep
from maxtext_sft.builders.jobs import notify_targets
from maxtext_sft.ui.notifier import OwnersNotifier

log = logging.getLogger(__name__)
GCP_CONN_ID = "google_cloud_default"
# Airflow config (AIRFLOW__MAXTEXT_SFT__JANITOR_INTERVAL_MINUTES): how often the janitor sweeps;
# 0: never on its own (a deployment that runs the janitor command from cron, the tests' Airflows
# that make VMs of runs that do not exist), only when triggered.
INTERVAL = timedelta(minutes=conf.getint("maxtext_sft", "janitor_interval_minutes", fallback=10))

def _run_not_found(error: Exception) -> bool:
    """A 404 from the execution API, in process (ServerResponseError) or through the supervisor."""
    response = getattr(error, "response", None)
    if getattr(response, "status_code", None) == 404:
        return True
    detail = f"{error!r} {getattr(error, 'detail', '')} {getattr(error, 'error', '')}".lower()
    return "not_found" in detail or "not found" in detail


with DAG(
    dag_id="maxtext_sft_janitor",
    description="Delete MaxText SFT VMs whose run is over or whose lifetime has passed",
    schedule=INTERVAL or None,
    catchup=False,
    max_active_runs=1,
    params={
        "project_id": Param(None, type=["null", "string"], description="Project to sweep; empty: the connection's."),
        "dry_run": Param(False, type="boolean", description="Only log what would be deleted."),
    },
    tags=["maxtext", "sft", "janitor"],
    default_args={"retries": 1, "retry_delay": timedelta(minutes=1), "owner": "ml-platform"},
    doc_md=__doc__,
) as dag:

    @task
    def delete_leaked_vms(**context) -> list[dict]:
        """List the package's VMs in every zone; delete those whose run is over or whose lifetime passed."""
        ti, params = context["ti"], context["params"]
        hook = ComputeEngineEndpointHook(gcp_conn_id=GCP_CONN_ID)

        def run_state(dag_id: str, run_id: str) -> str | None:
            try:
                state = ti.get_dagrun_state(dag_id=dag_id, run_id=run_id)
                return str(getattr(state, "value", state))  # a DagRunState enum, or its string
            except Exception as error:  # the Task SDK reports a missing run as an error
                if _run_not_found(error):
                    return None
                log.warning("Could not learn the state of %s/%s: %r", dag_id, run_id, error)
                return UNKNOWN

        deleted = sweep(hook, params["project_id"] or hook.project_id, run_state, dry_run=params["dry_run"])
        if not params["dry_run"]:
            tell_owners(deleted, context)
        return [vm.__dict__ for vm in deleted]

    def tell_owners(deleted, context) -> None:
        """A deleted VM of a declared job is news to its team: its run lost its VM, or leaked one."""
        targets = notify_targets()
        for vm in deleted:
            if vm.dag_id not in targets:
                continue
            target = targets[vm.dag_id]
            notifier = OwnersNotifier(
                target["conn_id"], to=target["to"], message=f"The janitor deleted VM {vm.name} ({vm.zone}): {vm.reason}"
            )
            details = {"dag_id": vm.dag_id, "run_id": vm.run_id, "vm_name": vm.name, "zone": vm.zone}
            try:
                notifier.notify({**context, "event": "vm_deleted_by_janitor", "details": details})
            except Exception:  # the deletion stands; a lost message must not hide the others
                log.exception("Could not notify %s about %s", target["conn_id"], vm.name)

    delete_leaked_vms()
