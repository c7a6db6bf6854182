"""Tell a job's owners that a run failed, or that the janitor deleted one of its VMs.

OwnersNotifier, an Airflow notifier (BaseNotifier): a declared job's DAG uses it as its
on_failure_callback (run by the DAG processor once the run has failed: see docs/notifications.md),
and the janitor calls it for each VM it deleted. The target is an Airflow connection, so webhook
URLs and passwords, which are secrets, stay in the secrets backend; its type, read when the message
is sent, picks Airflow's own notifier for it: a `slack_incoming_webhook` connection gets the Slack
provider's SlackWebhookNotifier, an `smtp` connection the SMTP provider's SmtpNotifier, anything
else a JSON POST (JobNotifier) to its host (`https://...`, or schema/host/port/path make one up).
"""

from __future__ import annotations

import json
import urllib.request
from typing import Any

from airflow.sdk import BaseHook, BaseNotifier, conf
from maxtext_sft.results.story import failure_message, run_url
from maxtext_sft.results.summary import FAILURE_KEY

SLACK_CONN_TYPE = "slack_incoming_webhook"
SMTP_CONN_TYPES = ("smtp", "email")  # the SMTP provider's type, and the name some deployments give it


def webhook_url(conn_id: str) -> str:
    connection = BaseHook.get_connection(conn_id)
    host = connection.host or ""
    if host.startswith(("http://", "https://")):
        return host
    scheme = connection.schema or "https"
    port = f":{connection.port}" if connection.port else ""
    path = (connection.extra_dejson or {}).get("path", "")
    return f"{scheme}://{host}{port}{path}"


class JobNotifier(BaseNotifier):
    """POST a JSON message about a run to the webhook in connection `conn_id`."""

    template_fields = ("message",)

    def __init__(self, conn_id: str, message: str = "", *, timeout: float = 30):
        super().__init__()
        self.conn_id = conn_id
        self.message = message
        self.timeout = timeout

    def notify(self, context: dict[str, Any]) -> None:
        dag_run = context.get("dag_run")
        payload = {
            "dag_id": getattr(context.get("dag"), "dag_id", None) or getattr(dag_run, "dag_id", None),
            "run_id": context.get("run_id") or getattr(dag_run, "run_id", None),
            "event": context.get("event", "run_failed"),
            "reason": context.get("reason"),
            "message": self.message or "The fine-tune run failed; its check_run_outcome log names the cause.",
        }
        payload.update(context.get("details") or {})
        request = urllib.request.Request(
            webhook_url(self.conn_id),
            data=json.dumps(payload, default=str).encode(),
            headers={"Content-Type": "application/json"},
            method="POST",
        )
        with urllib.request.urlopen(request, timeout=self.timeout) as response:  # noqa: S310 - the owner's URL
            self.log.info("Notified %s: HTTP %s", self.conn_id, response.status)


def failed_tasks(dag, run_id: str) -> list[tuple[str, str | None]]:
    """(task_id, recorded error) of the run's failed tasks, in the DAG's order (the runbook's).

    Read through the Task SDK (the DAG processor answers these requests for a DAG callback, as the
    api-server does for a task), so it works with or without a task instance in the context."""
    from airflow.sdk.execution_time.task_runner import RuntimeTaskInstance
    from airflow.sdk.execution_time.xcom import XCom

    states = RuntimeTaskInstance.get_task_states(dag_id=dag.dag_id, run_ids=[run_id]).get(run_id, {})
    order = [task_id for task_id in dag.task_ids if task_id in states] + sorted(set(states) - set(dag.task_ids))
    return [
        (task_id, XCom.get_one(key=FAILURE_KEY, dag_id=dag.dag_id, task_id=task_id, run_id=run_id))
        for task_id in order
        if states[task_id] == "failed"
    ]


class OwnersNotifier(BaseNotifier):
    """Tell the owners behind connection `conn_id` about a run: that it failed and why (no
    `message`), or `message` (the janitor's). `to`: the recipients when it is an SMTP connection."""

    def __init__(self, conn_id: str, to: list[str] | tuple[str, ...] = (), message: str = "", *, timeout: float = 30):
        super().__init__()
        self.conn_id = conn_id
        self.to = list(to)
        self.message = message
        self.timeout = timeout

    def notify(self, context: dict[str, Any]) -> None:
        dag_run = context.get("dag_run")
        details = context.get("details") or {}
        dag_id = details.get("dag_id") or getattr(context.get("dag"), "dag_id", None) or getattr(dag_run, "dag_id", None)
        run_id = details.get("run_id") or context.get("run_id") or getattr(dag_run, "run_id", None)
        url = run_url(conf.get("api", "base_url", fallback="http://localhost:8080/"), dag_id or "", run_id or "")
        if self.message:
            subject = f"[{dag_id}] {self.message}"[:250]
            body = "\n".join([self.message, f"DAG: {dag_id}", f"Run: {run_id}", f"Run page: {url}"])
            cause = self.message
        else:
            failed = failed_tasks(context["dag"], run_id)
            subject, body = failure_message(dag_id, run_id, url, failed, context.get("reason"))
            cause = body.split("\n", 1)[0]
        connection = BaseHook.get_connection(self.conn_id)
        if connection.conn_type == SLACK_CONN_TYPE:
            self._slack(body, context)
        elif connection.conn_type in SMTP_CONN_TYPES:
            self._email(subject, body, connection.extra_dejson.get("from_email"), context)
        else:
            webhook_details = {**details, "cause": cause, "run_url": url, "text": body}
            JobNotifier(self.conn_id, message=self.message or cause, timeout=self.timeout).notify(
                {**context, "details": webhook_details}
            )
        self.log.info("Told %s (%s connection): %s", self.conn_id, connection.conn_type, subject)

    def _slack(self, text: str, context) -> None:
        from airflow.providers.slack.notifications.slack_webhook import SlackWebhookNotifier

        # Plain text, no Block Kit: an error's own characters must not become markup.
        SlackWebhookNotifier(slack_webhook_conn_id=self.conn_id, text=text, timeout=int(self.timeout)).notify(context)

    def _email(self, subject: str, body: str, from_email: str | None, context) -> None:
        import html

        from airflow.providers.smtp.notifications.smtp import SmtpNotifier

        if not self.to:
            raise ValueError(
                f"Connection {self.conn_id!r} is an SMTP connection but the job names no recipients: "
                "give its notify block `to: [address, ...]`"
            )
        # Every field given (the sender from the connection, as the provider's hook reads it) and
        # its notify(), not its call: nothing, the error text least of all, is rendered as Jinja.
        SmtpNotifier(
            to=self.to,
            from_email=from_email,
            smtp_conn_id=self.conn_id,
            subject=subject,
            html_content=f"<pre>{html.escape(body)}</pre>",
        ).notify(context)
