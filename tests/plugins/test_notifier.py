"""A job's owners are told through the notifier that fits their connection's type, each against a
real local server: a Slack incoming webhook (an HTTP server the connection's host points at), an
SMTP server (aiosmtpd), a plain JSON webhook. Every message names the cause and the run's page."""

from __future__ import annotations

import logging

import pytest

from localcloud.smtp import MailReceiver, body_text
from localcloud.webhook import WebhookReceiver
from maxtext_sft.ui import notifier as notifier_module
from maxtext_sft.ui.notifier import OwnersNotifier

SLACK_TOKEN = "T0LOCAL/B0LOCAL/not-a-real-secret-4242"
DAG_ID, RUN_ID = "team_job", "scheduled__2026-11-02T00:00:00+00:00"
FAILED = [
    ("preflight", "AirflowFailException: Preflight failed, no VM was created:\n"
                  "reservation: reservation no-such-reservation in local-project/us-east5-b does not exist"),
    ("check_run_outcome", "AirflowFailException: The fine-tune did not complete (preflight=failed); the VM was deleted\n"
                          "Cause:\npreflight: AirflowFailException: Preflight failed, no VM was created: ..."),
]


class FakeDag:
    dag_id = DAG_ID
    task_ids = ["plan_run", "preflight", "check_run_outcome"]


@pytest.fixture
def run_failed_in_preflight(monkeypatch):
    """What the Task SDK would read of the run (tested against a real scheduler in
    tests/dags/test_declared_job_runs.py): preflight failed with its error recorded."""
    monkeypatch.setattr(notifier_module, "failed_tasks", lambda dag, run_id: FAILED)
    monkeypatch.setenv("AIRFLOW__API__BASE_URL", "http://airflow.example:8080")
    return {"dag": FakeDag(), "run_id": RUN_ID, "reason": "task_failure"}


def test_a_slack_connection_gets_the_cause_through_the_slack_provider(run_failed_in_preflight, monkeypatch, caplog):
    with WebhookReceiver() as slack:
        monkeypatch.setenv("AIRFLOW_CONN_TEAM_SLACK", slack.slack_connection_uri(SLACK_TOKEN))
        with caplog.at_level(logging.DEBUG):
            OwnersNotifier("team_slack").notify(run_failed_in_preflight)
        [message] = slack.wait_for(lambda m: True, timeout=5)
    assert slack.paths == [f"/services/{SLACK_TOKEN}"]  # the provider's URL: host + "/" + token
    assert set(message) == {"text"}
    text = message["text"]
    assert text.startswith("Fine-tune run failed at preflight: Preflight failed, no VM was created: reservation: reservation no-such-reservation")
    assert f"DAG: {DAG_ID}" in text and f"Run: {RUN_ID}" in text
    assert "Run page: http://airflow.example:8080/dags/team_job/runs/scheduled__2026-11-02T00%3A00%3A00%2B00%3A00" in text
    assert "The fine-tune did not complete (preflight=failed)" in text  # check_run_outcome's whole error
    assert SLACK_TOKEN not in caplog.text and "not-a-real-secret" not in caplog.text


def test_an_smtp_connection_mails_the_cause_to_the_jobs_recipients(run_failed_in_preflight, monkeypatch):
    with MailReceiver() as smtp:
        monkeypatch.setenv("AIRFLOW_CONN_TEAM_MAIL", smtp.connection_uri("airflow@example.com"))
        OwnersNotifier("team_mail", to=["ml-team@example.com", "oncall@example.com"]).notify(run_failed_in_preflight)
        [mail] = smtp.wait_for(lambda m: True, timeout=10)
    assert smtp.envelopes == [("airflow@example.com", ["ml-team@example.com", "oncall@example.com"])]
    assert mail["Subject"] == f"[{DAG_ID}] Fine-tune run failed at preflight: Preflight failed, no VM was created: reservation: reservation no-such-reservation in local-project/us-east5-b does not exist"
    body = body_text(mail)
    assert "reservation no-such-reservation in local-project/us-east5-b does not exist" in body
    assert "/dags/team_job/runs/" in body and f"DAG: {DAG_ID}" in body


def test_an_smtp_connection_without_recipients_says_where_they_go(run_failed_in_preflight, monkeypatch):
    with MailReceiver() as smtp:
        monkeypatch.setenv("AIRFLOW_CONN_TEAM_MAIL", smtp.connection_uri("airflow@example.com"))
        with pytest.raises(ValueError, match=r"'team_mail' is an SMTP connection .* notify block `to:"):
            OwnersNotifier("team_mail").notify(run_failed_in_preflight)
    assert smtp.messages == []


def test_any_other_connection_gets_the_json_post_with_the_cause(run_failed_in_preflight, monkeypatch):
    with WebhookReceiver() as webhook:
        monkeypatch.setenv("AIRFLOW_CONN_TEAM_HOOK", webhook.connection_uri())
        OwnersNotifier("team_hook").notify(run_failed_in_preflight)
        [message] = webhook.wait_for(lambda m: True, timeout=5)
    assert message["dag_id"] == DAG_ID and message["run_id"] == RUN_ID and message["event"] == "run_failed"
    assert message["message"].startswith("Fine-tune run failed at preflight: Preflight failed, no VM was created: reservation")
    assert message["run_url"].startswith("http://airflow.example:8080/dags/team_job/runs/")
    assert "check_run_outcome" not in message["message"] and "(preflight=failed)" in message["text"]


def test_the_janitors_message_names_why_it_deleted_the_vm_on_slack(monkeypatch):
    with WebhookReceiver() as slack:
        monkeypatch.setenv("AIRFLOW_CONN_TEAM_SLACK", slack.slack_connection_uri(SLACK_TOKEN))
        OwnersNotifier("team_slack", message="The janitor deleted VM vm-1 (us-east5-b): its lifetime ended").notify(
            {"event": "vm_deleted_by_janitor", "details": {"dag_id": DAG_ID, "run_id": RUN_ID, "vm_name": "vm-1"}}
        )
        [message] = slack.wait_for(lambda m: True, timeout=5)
    assert message["text"].startswith("The janitor deleted VM vm-1 (us-east5-b): its lifetime ended")
    assert f"DAG: {DAG_ID}" in message["text"] and "/dags/team_job/runs/" in message["text"]
