"""The run's note (shown at the top of its page in the UI) says how a fine-tune run ended: the first
failed task and its error, or its steps, final loss and where the model went.

An Airflow listener (plugins/run_notes_plugin.py registers this module). Airflow calls a DAG run's
on_dag_run_failed / on_dag_run_success hooks in the process that ended the run: the scheduler
(models/dagrun.py DagRun.update_state -> notify_dagrun_state_changed, and the dagrun-timeout path
of jobs/scheduler_job_runner.py), or the api-server when a user marks the run failed or successful
(api_fastapi/core_api/services/public/dag_run.py). Both hold the run in a database session they
commit after the hook returns. The note is set on that session's run, and nothing else is done in
it: the scheduler forbids a commit inside its scheduling loop (a savepoint's release counts as one,
"UNEXPECTED COMMIT"), and a failed query would spoil its transaction. What the note says is read in
a session of its own (not Airflow's thread-local one, which is the scheduler's), from what the tasks committed (their states and recorded errors). The Task
SDK can only read a run's note, and the REST API would need a user's credentials; this needs neither.

Imports beyond Airflow's listener marker happen inside the hooks: Airflow imports plugins in
every one of its processes.
"""

from __future__ import annotations

import logging

from airflow.listeners import hookimpl

log = logging.getLogger(__name__)
SUMMARY_TASK = "summarize_run"


@hookimpl
def on_dag_run_failed(dag_run, msg: str) -> None:
    _write_note(dag_run, succeeded=False, reason=msg)


@hookimpl
def on_dag_run_success(dag_run, msg: str) -> None:
    _write_note(dag_run, succeeded=True, reason=msg)


def _write_note(dag_run, *, succeeded: bool, reason: str | None) -> None:
    from sqlalchemy.orm import object_session

    from airflow import settings

    if object_session(dag_run) is None:  # not from a session Airflow commits: nothing would keep the note
        log.warning("No database session holds run %s: its note is not written", dag_run.run_id)
        return
    try:
        existing = dag_run.dag_run_note
        if existing is not None and existing.user_id is not None:
            return  # a person's note stays as they wrote it
        # A session of its own, not settings.Session (create_session): that is the scheduler's own
        # thread-local session, which closing would detach the scheduler's objects from.
        with settings.NonScopedSession() as reading:
            note = _note_for(reading, dag_run, succeeded=succeeded, reason=reason)
        if note is None:
            return
        dag_run.note = note  # committed with the run's new state by the caller
    except Exception:  # a note is not worth a scheduler's loop
        log.exception("Could not write the note of run %s", dag_run.run_id)
        return
    log.info("Note of run %s/%s: %s", dag_run.dag_id, dag_run.run_id, note.splitlines()[0])


def _note_for(session, dag_run, *, succeeded: bool, reason: str | None) -> str | None:
    """The note for a fine-tune run (one with a verdict task), from what its tasks committed."""
    from sqlalchemy import select

    from airflow.models.taskinstance import TaskInstance
    from airflow.models.xcom import XComModel
    from maxtext_sft.results.story import VERDICT_TASKS, failure_note, success_note
    from maxtext_sft.results.summary import FAILURE_KEY

    rows = session.execute(
        select(TaskInstance.task_id, TaskInstance.state, TaskInstance.end_date).where(
            TaskInstance.dag_id == dag_run.dag_id, TaskInstance.run_id == dag_run.run_id
        )
    ).all()
    if not any(row.task_id in VERDICT_TASKS for row in rows):
        return None  # not a run of this package's pipelines

    def xcom(task_id: str, key: str):
        found = session.execute(
            select(XComModel.value).where(
                XComModel.dag_run_id == dag_run.id, XComModel.task_id == task_id, XComModel.key == key
            ).limit(1)
        ).first()
        return XComModel.deserialize_value(found) if found else None

    if succeeded:
        return success_note(xcom(SUMMARY_TASK, "return_value"))
    failed = sorted(
        (row for row in rows if row.state == "failed"),
        key=lambda row: (row.end_date is None, row.end_date),  # the first to fail first
    )
    return failure_note([(row.task_id, xcom(row.task_id, FAILURE_KEY)) for row in failed], reason)
