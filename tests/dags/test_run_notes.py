"""A failed fine-tune run says why where its users look, through Airflow's real scheduler
(PostgreSQL) and DAG processor: its run note (the run_notes listener, in the scheduler), its
page in the UI (headless Chromium, no task log opened), and its owners' Slack channel and mailbox
(the DAG's on_failure_callback, run by the DAG processor, through the providers' notifiers)."""

from __future__ import annotations

import json
import os
import urllib.parse

import pytest
import yaml
from selenium.webdriver.common.by import By
from selenium.webdriver.support import expected_conditions as EC
from selenium.webdriver.support.ui import WebDriverWait

from localcloud.connections import LOCAL_RUN_CONF
from localcloud.smtp import MailReceiver, body_text
from localcloud.webhook import WebhookReceiver
from tests.dags.conftest import airflow_on_fresh_database, wait_for_run_end, wait_until
from tests.dags.test_ui import ARTIFACTS, UI_TIMEOUT, chromium, save_artifact

pytestmark = pytest.mark.e2e

USER, PASSWORD = "admin", "run-notes-password"
SLACK_TOKEN = "T0NOTES/B0NOTES/run-notes-webhook-secret"
LOADER = 'from airflow.sdk import DAG\nfrom maxtext_sft.builders.jobs import declared_job_dag\ndag: DAG = declared_job_dag("{}")\n'
JOBS = {  # dag_id -> its notify block
    "team_slack_job": {"conn_id": "team_slack"},
    "team_mail_job": {"conn_id": "team_mail", "to": ["ml-team@example.com"]},
}
CAUSE = "no-such-reservation in local-project/us-east5-b does not exist"  # preflight's words


@pytest.fixture(scope="module")
def failed_runs(tmp_path_factory, pipeline_connections, postgres_server, migrated_database, local_cloud):
    """One run of each job, refused by preflight (no such reservation): (airflow, {dag_id: run},
    the Slack endpoint, the SMTP server)."""
    root = tmp_path_factory.mktemp("run-notes")
    jobs, dags = root / "jobs", root / "dags"
    jobs.mkdir(), dags.mkdir()
    for dag_id, notify in JOBS.items():
        (jobs / f"{dag_id}.yaml").write_text(yaml.safe_dump({
            "dag_id": dag_id, "schedule": "@daily", "start_date": "2026-11-01", "notify": notify,
            "end_date": "2026-11-04",  # no scheduled run once unpaused: only the test's
            "params": {**LOCAL_RUN_CONF, "reservation": "no-such-reservation"},
        }))
        (dags / f"job_{dag_id}.py").write_text(LOADER.format(f"{dag_id}.yaml"))
    with WebhookReceiver() as slack, MailReceiver() as smtp:
        env = {
            **pipeline_connections,
            "MAXTEXT_SFT_JOBS_DIR": str(jobs),
            "AIRFLOW_CONN_TEAM_SLACK": slack.slack_connection_uri(SLACK_TOKEN),
            "AIRFLOW_CONN_TEAM_MAIL": smtp.connection_uri("airflow@example.com"),
        }
        with airflow_on_fresh_database(
            root / "airflow-home", {**os.environ, **env}, postgres_server, migrated_database,
            dags_folder=dags, dag_id="team_slack_job", users={USER: PASSWORD},
        ) as airflow:
            runs = {}
            for dag_id in JOBS:  # a declared job is created paused
                # Airflow's start waited for the first job's DAG only; the other file may parse later.
                wait_until(lambda: airflow.get(f"/api/v2/dags/{dag_id}", missing_ok=True), 300, f"{dag_id} parsed")  # noqa: B023
                airflow.request("PATCH", f"/api/v2/dags/{dag_id}?update_mask=is_paused", {"is_paused": False})
                runs[dag_id] = airflow.trigger({}, dag_id=dag_id)
            ended = {dag_id: wait_for_run_end(airflow, run_id, timeout=300, dag_id=dag_id) for dag_id, run_id in runs.items()}
            yield airflow, ended, slack, smtp


def test_the_failed_runs_note_names_the_first_failed_task_and_its_error(failed_runs):
    airflow, runs, _, _ = failed_runs
    for dag_id, run in runs.items():
        assert run["state"] == "failed"
        states = airflow.task_states(run["dag_run_id"], dag_id)
        assert states["preflight"] == "failed" and states["check_run_outcome"] == "failed", states
        note = airflow.run(run["dag_run_id"], dag_id)["note"]
        assert note.startswith("Failed at preflight: Preflight failed, no VM was created: reservation: "), note
        assert CAUSE in note, note
        assert "check_run_outcome" not in note  # the verdict is not the cause
        assert len(note) <= 1000


def test_the_slack_channel_is_told_the_cause_and_the_runs_page(failed_runs):
    _, runs, slack, _ = failed_runs
    run_id = runs["team_slack_job"]["dag_run_id"]
    [message] = slack.wait_for(lambda m: run_id in m.get("text", ""), timeout=120)
    assert slack.paths == [f"/services/{SLACK_TOKEN}"]
    text = message["text"]
    assert text.startswith("Fine-tune run failed at preflight: Preflight failed, no VM was created: ") and CAUSE in text
    assert "DAG: team_slack_job" in text and f"Run: {run_id}" in text
    assert f"/dags/team_slack_job/runs/{urllib.parse.quote(run_id, safe='')}" in text
    assert "The fine-tune did not complete" in text  # check_run_outcome's error, read from XCom by the processor


def test_the_mailbox_is_told_the_cause_and_the_runs_page(failed_runs):
    _, runs, _, smtp = failed_runs
    run_id = runs["team_mail_job"]["dag_run_id"]
    [mail] = smtp.wait_for(lambda m: run_id in body_text(m), timeout=120)
    assert mail["To"] == "ml-team@example.com" and mail["From"] == "airflow@example.com"
    assert mail["Subject"].startswith("[team_mail_job] Fine-tune run failed at preflight: Preflight failed, no VM")
    body = body_text(mail)
    assert CAUSE in body and f"/dags/team_mail_job/runs/{urllib.parse.quote(run_id, safe='')}" in body


def test_no_secret_reaches_the_logs(failed_runs):
    airflow, runs, slack, _ = failed_runs
    slack.wait_for(lambda m: True, timeout=120)
    for component in ("scheduler", "dag-processor", "api-server", "triggerer"):
        assert "run-notes-webhook-secret" not in airflow.log_tail(component, size=10**7), component
    # The DAG processor's own log files, where the failure callback logs.
    for path in (airflow.home / "logs").rglob("*"):
        if path.is_file():
            assert "run-notes-webhook-secret" not in path.read_text(errors="replace"), path
    for dag_id, run in runs.items():
        for task_id in ("preflight", "check_run_outcome"):
            entries = airflow.get(
                f"/api/v2/dags/{dag_id}/dagRuns/{run['dag_run_id']}/taskInstances/{task_id}/logs/1?full_content=true"
            )["content"]
            assert "run-notes-webhook-secret" not in json.dumps(entries)


def test_the_failed_runs_page_shows_the_cause_without_opening_a_log(failed_runs, tmp_path):
    airflow, runs, _, _ = failed_runs
    run_id = runs["team_slack_job"]["dag_run_id"]
    page = f"{airflow.url}/dags/team_slack_job/runs/{urllib.parse.quote(run_id, safe='')}"
    (ARTIFACTS / "failed-run-page.png").unlink(missing_ok=True)
    with chromium(tmp_path / "chromium-profile") as driver:
        driver.set_window_size(1600, 1000)
        try:
            driver.get(page)
            wait = WebDriverWait(driver, UI_TIMEOUT)
            wait.until(EC.visibility_of_element_located((By.NAME, "username"))).send_keys(USER)
            driver.find_element(By.NAME, "password").send_keys(PASSWORD)
            wait.until(EC.element_to_be_clickable((By.CSS_SELECTOR, 'button[type="submit"]'))).click()
            wait.until(EC.text_to_be_present_in_element((By.TAG_NAME, "body"), CAUSE))
            assert "/tasks/" not in driver.current_url  # the run's page, not a task's log
            save_artifact(driver, "failed-run-page")
        except BaseException:
            save_artifact(driver, "failed-run-page-failure")
            raise
    assert "Failed at preflight" in (ARTIFACTS / "failed-run-page.html").read_text()
