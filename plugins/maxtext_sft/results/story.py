"""A finished run told in a user's words: the run's note (run_notes) and its owners' notification
(notifier) name the first task that failed and its error, or the success's steps, loss and model.

Pure functions of what the tasks left behind (their states, the errors outcome.record_failure kept
under results.summary.FAILURE_KEY, the run summary), so tests need no Airflow.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any
from urllib.parse import quote

# The tasks that only give the run its verdict, listing the other failures (tasks/outcome.py): the cause
# is the task they name, they are it only when nothing else failed.
VERDICT_TASKS = ("check_run_outcome", "check_bake_outcome")
# Airflow keeps a run's note in a column of 1,000 characters (DagRunNote.content).
NOTE_LIMIT = 1000
ERROR_LIMIT = 300
# Airflow's exception types that only say "fail without retrying": not part of the cause.
WRAPPER_TYPES = ("AirflowFailException: ", "AirflowException: ")


def short_error(error: str | None, limit: int = ERROR_LIMIT) -> str:
    """The error's first line (record_failure's first line says what failed), with the lines a
    first line ending in ':' introduces (preflight's list of causes), at most `limit` long."""
    lines = [line.strip() for line in (error or "").strip().splitlines()]
    text = lines[0] if lines else ""
    for line in lines[1:]:
        if not text.endswith(":") or not line:
            break
        text = f"{text} {line}"
    text = text.removeprefix(WRAPPER_TYPES[0]).removeprefix(WRAPPER_TYPES[1])
    return text if len(text) <= limit else text[: limit - 3] + "..."


def failure_cause(failed: Sequence[tuple[str, str | None]]) -> tuple[str, str] | None:
    """(task_id, error) of the first failed task, `failed` in the order they failed; a verdict
    task only when no other task failed (its error then lists what did not complete)."""
    causes = [row for row in failed if row[0] not in VERDICT_TASKS] or list(failed)
    if not causes:
        return None
    task_id, error = causes[0]
    return task_id, error or "no error was recorded (see the task's log)"


def verdict_error(failed: Sequence[tuple[str, str | None]]) -> str | None:
    """The verdict task's error (every failed task's state and recorded error), if it failed."""
    return next((error for task_id, error in failed if task_id in VERDICT_TASKS and error), None)


def failure_note(failed: Sequence[tuple[str, str | None]], reason: str | None = None) -> str:
    """The failed run's note: the first failed task and its error, short; the others by name."""
    cause = failure_cause(failed)
    if cause is None:
        why = f" ({reason})" if reason else ""
        return f"Failed{why}: no task failed; the run was stopped or timed out."
    task_id, error = cause
    others = [t for t, _ in failed if t != task_id and t not in VERDICT_TASKS]
    note = f"Failed at {task_id}: {short_error(error)}"
    if others:
        note += f"\nAlso failed: {', '.join(others)}."
    return note[:NOTE_LIMIT]


def success_note(summary: Mapping[str, Any] | None) -> str:
    """The succeeded run's note, from the run summary (summarize_run's XCom): steps, final loss,
    where the model went."""
    summary = summary or {}
    parts = []
    if summary.get("final_step") is not None:
        parts.append(f"{summary['final_step']} steps")
    if summary.get("final_loss") is not None:
        try:
            parts.append(f"final loss {float(summary['final_loss']):.4g}")
        except (TypeError, ValueError):
            parts.append(f"final loss {summary['final_loss']}")
    eval_loss = summary.get("eval_loss") or {}
    if eval_loss.get("base") is not None and eval_loss.get("tuned") is not None:
        parts.append(f"eval loss {eval_loss['base']:.4g} -> {eval_loss['tuned']:.4g}")
    published = summary.get("published")
    if published and published.get("published", True):  # a summary from before the gate has no flag
        parts.append(f"published to {published.get('repo_id')}@{published.get('branch')}")
    elif published and published.get("reason"):
        parts.append(f"not published: {published['reason']}")
    else:
        parts.append("not published")
    export = (summary.get("outputs") or {}).get("hf_export")
    if export:
        parts.append(f"model at {export}")
    return f"Succeeded: {', '.join(parts)}."[:NOTE_LIMIT]


def run_url(base_url: str, dag_id: str, run_id: str) -> str:
    """The run's page in Airflow 3's UI (the path its task log links use)."""
    return f"{base_url.rstrip('/')}/dags/{quote(dag_id, safe='')}/runs/{quote(run_id, safe='')}"


def failure_message(
    dag_id: str, run_id: str, url: str, failed: Sequence[tuple[str, str | None]], reason: str | None
) -> tuple[str, str]:
    """(subject, body) of the notification that a run failed: the cause first, then every
    failed task's error as check_run_outcome listed it, and the run's page."""
    cause = failure_cause(failed)
    headline = (
        f"Fine-tune run failed at {cause[0]}: {short_error(cause[1], 200)}" if cause
        else f"Fine-tune run failed ({reason or 'no task failed'})"
    )
    lines = [
        headline,
        f"DAG: {dag_id}",
        f"Run: {run_id}",
        f"Run page: {url}",
    ]
    verdict = verdict_error(failed)
    if verdict:
        lines += ["", verdict]
    elif cause:
        lines += ["", f"{cause[0]}: {cause[1]}"]
    return f"[{dag_id}] {headline}"[:250], "\n".join(lines)
