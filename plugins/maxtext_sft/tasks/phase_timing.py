"""Each task's phase for the run summary: its first start, its end, its tries and its final state.

In Airflow 3 a task has no database access, and nothing the Task SDK offers at a task's end is
its phase: `ti.start_date` is the current try's start, and for a reschedule-mode sensor the start
of its last poke; breadcrumbs give only the last run's duration; XCom is cleared at every retry
and every poke. (All measured in tests/plugins/test_phase_timing.py.) What survives retries and
reschedules is the task state store (Airflow 3.3; one per task of a DAG run): the first start is
kept there, and the end callbacks push the phase record as XCom for summarize_run to read.

Wire through the DAG's default_args (with `record_failure` as before):
    "on_execute_callback": note_phase_start,
    "on_success_callback": record_phase,
    "on_failure_callback": [record_failure, record_phase],
Airflow runs callbacks in the task's process after its state is reported, and logs and swallows
their errors, so timing can never fail a task.
"""

from __future__ import annotations

from datetime import datetime, timedelta, timezone

from maxtext_sft.run.params import MAX_RUN_DURATION_LIMITS_SECONDS
from maxtext_sft.results.summary import PHASE_KEY
# Context key carrying the first start from note_phase_start to record_phase (one process).
_STARTED = "maxtext_sft_phase_started"
# The first start must outlive the longest run (a VM lives at most 120 days), whatever the
# deployment's [state_store] default_retention_days.
RETENTION = timedelta(seconds=MAX_RUN_DURATION_LIMITS_SECONDS[1], days=1)


def _store_key(context) -> str:
    # Clearing a DAG run keeps its state store (same run), so each generation has its own key.
    return f"phase_started_g{context['dag_run'].clear_number or 0}"


def note_phase_start(context) -> None:
    """on_execute_callback: remember the phase's first start (first try, a sensor's first poke)."""
    store = context["task_state_store"]
    started = store.get(_store_key(context))
    if started is None:
        started = context["ti"].start_date.isoformat()
        store.set(_store_key(context), started, retention=RETENTION)
    # Kept in memory for record_phase too: with [state_store] clear_on_success the store is
    # emptied when the task succeeds, before on_success_callback runs.
    context[_STARTED] = started


def record_phase(context) -> None:
    """on_success_callback and on_failure_callback: push the phase record as XCom."""
    ti = context["ti"]
    started = context.get(_STARTED) or (ti.start_date.isoformat() if ti.start_date else None)
    ended = ti.end_date or datetime.now(timezone.utc)
    ti.xcom_push(
        key=PHASE_KEY,
        value={
            "started": started,  # the first try's start (a sensor's first poke), when note_phase_start ran
            "ended": ended.isoformat(),
            "try_number": ti.try_number,
            "state": getattr(ti.state, "value", ti.state),
        },
    )
