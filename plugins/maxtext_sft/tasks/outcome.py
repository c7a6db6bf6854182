"""The run's verdict: succeed only when every task of the run succeeded."""

from __future__ import annotations

from airflow.sdk import task
from airflow.sdk.exceptions import AirflowFailException
from maxtext_sft.results.summary import FAILURE_KEY


def record_failure(context) -> None:
    """on_failure_callback: keep the error, so the run's own error can name the cause."""
    error = context.get("exception")
    if error is not None:
        text = f"{type(error).__name__}: {error}"
        if len(text) > 2000:  # its first line says what failed, its end (a log tail) says why
            first, _, rest = text.partition("\n")
            text = f"{first[:500]}\n...\n{rest[-1500:]}"
        context["ti"].xcom_push(key=FAILURE_KEY, value=text)


def failed_tasks(
    states: dict[str, str | None], ignore: set[str], ok: frozenset[str] = frozenset({"success"})
) -> dict[str, str | None]:
    return {task_id: state for task_id, state in sorted(states.items()) if task_id not in ignore and state not in ok}


def fail_unless_every_task_ok(
    context, what: str, vm_delete_task: str, ok: frozenset[str] = frozenset({"success"})
) -> None:
    """Fail naming the tasks of this run (setups and the calling task aside) whose state is not
    in `ok`, with the errors they left (record_failure), and whether `vm_delete_task` deleted the VM."""
    ti, dag_run = context["ti"], context["dag_run"]
    states = ti.get_task_states(dag_id=dag_run.dag_id, run_ids=[dag_run.run_id]).get(dag_run.run_id, {})
    setups = {t.task_id for t in context["dag"].tasks if t.is_setup}
    not_ok = failed_tasks(states, ignore={ti.task_id, *setups}, ok=ok)
    if not_ok:
        listed = ", ".join(f"{task_id}={state}" for task_id, state in not_ok.items())
        vm = "the VM may still exist" if vm_delete_task in not_ok else "the VM was deleted"
        causes = [
            f"{task_id}: {reason}"
            for task_id, state in not_ok.items()
            if state == "failed" and (reason := ti.xcom_pull(task_ids=task_id, key=FAILURE_KEY))
        ]
        because = "\n".join(["", "Cause:", *causes]) if causes else ""
        raise AirflowFailException(f"{what} did not complete ({listed}); {vm}{because}")


@task(retries=0)
def check_run_outcome(vm_delete_task: str, **context):
    """Fail the run, naming the tasks that did not succeed; teardowns alone cannot fail it."""
    fail_unless_every_task_ok(context, "The fine-tune", vm_delete_task)


@task(retries=0)
def check_bake_outcome(vm_delete_task: str, **context):
    """Fail the bake unless every task succeeded or was skipped (a family that already holds the
    version skips the bake: that is success)."""
    fail_unless_every_task_ok(context, "The bake", vm_delete_task, ok=frozenset({"success", "skipped"}))
