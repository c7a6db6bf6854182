"""Tell a job's owners that a run failed, or that the janitor deleted one of its VMs.

An Airflow notifier (BaseNotifier): a declared job's DAG uses it as its on_failure_callback (run
by the DAG processor once the run has failed), and the janitor calls it for each VM it deleted.
The target is an Airflow connection, so webhook URLs, which are secrets, stay in the secrets
backend: its host is the URL (`https://...`), or schema/host/port/path make one up.
"""

from __future__ import annotations

import json
import urllib.request
from typing import Any

from airflow.sdk import BaseHook, BaseNotifier


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
