"""The arguments of a trigger the scheduler starts a task with (`start_from_trigger`): no worker
runs before it. They are fixed when the DAG is written, so a value another task computes goes as a
template of its XCom, which Airflow 3.3's triggerer renders with the task's context (only
arguments named as one of the task's template fields are rendered); the trigger decodes them."""

from __future__ import annotations

import json
from typing import Any

from airflow.sdk import XComArg


def xcom_json_template(task_id: str, key: str) -> str:
    """Task `task_id`'s XCom `key` as JSON text: the triggerer renders in a sandboxed Jinja
    environment (text), and tojson's escapes are JSON's. map_indexes=-1 makes xcom_pull ask for
    the one XCom (GetXCom): without it, it asks for every map index's (GetXComSequenceSlice), which
    Airflow 3.3.2's triggerer does not serve: "Unable to decode message", and the trigger waits for
    an answer for ever (the same message as the DAG processor's in apache/airflow#55464)."""
    return "{{ ti.xcom_pull(task_ids=%r, key=%r, map_indexes=-1) | tojson }}" % (task_id, key)


def xcom_arg_template(value: Any) -> str | None:
    """The template of an XComArg's XCom (another task's output, or one key of it) as JSON text;
    None for any other value."""
    operator, key = getattr(value, "operator", None), getattr(value, "key", None)
    if not isinstance(value, XComArg) or operator is None or not isinstance(key, str):
        return None
    return xcom_json_template(operator.task_id, key)


def from_json(text: str | Any) -> Any:
    """A rendered template's value (a value that was not text is itself)."""
    return json.loads(text) if isinstance(text, str) else text
