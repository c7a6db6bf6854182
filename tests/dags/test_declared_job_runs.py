"""Declared jobs (their YAML and loaders in folders of their own, the repo's jobs left out)
through Airflow's real scheduler (PostgreSQL) and DAG processor, on one Airflow for this file.

A failed fine-tune run says why where its users look: its run note (the run_notes listener, in the
scheduler), its page in the UI (headless Chromium, no task log opened), and its owners' Slack
channel, mailbox and webhook (the DAG's on_failure_callback, run by the DAG processor, through the
providers' notifiers).

A declared job backfilled over three days: each run pins its own dataset snapshot, trains on its
own VM under its own run_name and writes its own outputs; the reservation holds two VMs, so the
capacity gate makes the third run wait (deferred, holding no worker slot) instead of failing."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.parse
from datetime import datetime, timedelta, timezone
from types import SimpleNamespace

import pytest
import yaml
from selenium.webdriver.common.by import By
from selenium.webdriver.support import expected_conditions as EC
from selenium.webdriver.support.ui import WebDriverWait

from bench.run import compute_operations
from localcloud.connections import LOCAL_HUB_USER, LOCAL_OUTPUTS_CONF, LOCAL_PROJECT, LOCAL_RUN_CONF
from localcloud.smtp import MailReceiver, body_text
from localcloud.webhook import WebhookReceiver
from maxtext_sft.cloud.compute import ComputeEngineEndpointHook
from maxtext_sft.cloud.instances import EXPIRY_LABEL
from maxtext_sft.cloud.storage import StorageEndpointHook
from tests.conftest import REPO
from tests.plugins.test_spec import make_spec
from tests.test_recipes import recipe
from tests.dags.conftest import module_airflow, wait_for_run_end, wait_until
from tests.dags.test_ui import ARTIFACTS, UI_TIMEOUT, chromium, save_artifact

pytestmark = pytest.mark.e2e

USER, PASSWORD = "admin", "run-notes-password"
JANITOR_PASSWORD = "janitor's \"password\""  # quotes: the recipe's login file must escape them
SLACK_TOKEN = "T0NOTES/B0NOTES/run-notes-webhook-secret"
LOADER = 'from airflow.sdk import DAG\nfrom maxtext_sft.builders.jobs import declared_job_dag\ndag: DAG = declared_job_dag("{}")\n'
NOTIFIED_JOBS = {  # dag_id -> its notify block: each job's run is refused by preflight
    "team_slack_job": {"conn_id": "team_slack"},
    "team_mail_job": {"conn_id": "team_mail", "to": ["ml-team@example.com"]},
}
CAUSE = "no-such-reservation in local-project/us-east5-b does not exist"  # preflight's words

DAG_ID = "team_nightly"  # the backfilled job
DATASET = f"{LOCAL_HUB_USER}/daily-chats"  # the test token's own namespace
RESERVATION = "backfill-reservation"
CAPACITY = 2
# Three runs on a reservation of two: one more than it holds is enough to make a run wait (a
# fourth run added ~a quarter to the test's CPU, every task a process, and proved nothing more).
DAYS = [datetime(2026, 11, day, tzinfo=timezone.utc) for day in (1, 2, 3)]


def write_jobs(root) -> tuple:
    """The three jobs' YAML files and their loaders: (jobs folder, DAGs folder)."""
    jobs, dags = root / "jobs", root / "dags"
    jobs.mkdir(), dags.mkdir()
    for dag_id, notify in NOTIFIED_JOBS.items():
        (jobs / f"{dag_id}.yaml").write_text(yaml.safe_dump({
            "dag_id": dag_id, "schedule": "@daily", "start_date": "2026-11-01", "notify": notify,
            "end_date": "2026-11-04",  # no scheduled run once unpaused: only the test's
            "params": {**LOCAL_RUN_CONF, "reservation": "no-such-reservation"},
        }))
        (dags / f"job_{dag_id}.py").write_text(LOADER.format(f"{dag_id}.yaml"))
    (jobs / "team-nightly.yaml").write_text(yaml.safe_dump({
        "dag_id": DAG_ID,
        "schedule": "@daily",
        "start_date": "2026-11-01",
        "end_date": "2026-11-03",  # no scheduled run once unpaused: only the backfill's
        "notify": {"conn_id": "team_webhook"},
        "params": {
            **LOCAL_RUN_CONF,
            "reservation": RESERVATION,
            "dataset_name": DATASET,
            "output_location": f"{LOCAL_OUTPUTS_CONF['output_location']}/backfill",  # its own conversion cache
            "steps": 20,
            "max_capacity_wait_minutes": 30,
        },
    }))
    (dags / "job_team_nightly.py").write_text(LOADER.format("team-nightly.yaml"))
    return jobs, dags


# A failed run's notification comes from the DAG processor, which runs the DAG's on_failure_callback
# when it next parses the job's file: beside the whole suite on two cores that once took more than
# 120 s after the run's end (a fresh clone's `make test`); alone the test passes well within it.
NOTIFIED_WITHIN = 300


@pytest.fixture(scope="module")
def jobs_airflow(tmp_path_factory, pipeline_connections, postgres_server, migrated_database, local_cloud):
    """One Airflow for the three declared jobs, whose user must log in, with their owners' Slack
    channel, mailbox and webhook: (airflow, slack, smtp, webhook)."""
    root = tmp_path_factory.mktemp("declared-jobs")
    jobs, dags = write_jobs(root)
    with WebhookReceiver() as slack, MailReceiver() as smtp, WebhookReceiver() as webhook:
        settings = {
            "MAXTEXT_SFT_JOBS_DIR": str(jobs),
            "AIRFLOW_CONN_TEAM_SLACK": slack.slack_connection_uri(SLACK_TOKEN),
            "AIRFLOW_CONN_TEAM_MAIL": smtp.connection_uri("airflow@example.com"),
            "AIRFLOW_CONN_TEAM_WEBHOOK": webhook.connection_uri(),
        }
        with module_airflow(
            tmp_path_factory, pipeline_connections, postgres_server, migrated_database, settings,
            dags_folder=dags, dag_id="team_slack_job", users={USER: PASSWORD, "janitor": JANITOR_PASSWORD}, parallelism=6,
        ) as airflow:
            yield SimpleNamespace(airflow=airflow, slack=slack, smtp=smtp, webhook=webhook)


@pytest.fixture(scope="module")
def failed_runs(jobs_airflow):
    """One run of each notified job, refused by preflight (no such reservation): (airflow,
    {dag_id: run}, the Slack endpoint, the SMTP server)."""
    airflow = jobs_airflow.airflow
    runs = {}
    for dag_id in NOTIFIED_JOBS:  # a declared job is created paused
        # Airflow's start waited for the first job's DAG only; the other files may parse later.
        wait_until(lambda: airflow.get(f"/api/v2/dags/{dag_id}", missing_ok=True), 300, f"{dag_id} parsed")  # noqa: B023
        airflow.request("PATCH", f"/api/v2/dags/{dag_id}?update_mask=is_paused", {"is_paused": False})
        runs[dag_id] = airflow.trigger({}, dag_id=dag_id)
    ended = {dag_id: wait_for_run_end(airflow, run_id, timeout=300, dag_id=dag_id) for dag_id, run_id in runs.items()}
    return airflow, ended, jobs_airflow.slack, jobs_airflow.smtp


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
    [message] = slack.wait_for(lambda m: run_id in m.get("text", ""), timeout=NOTIFIED_WITHIN)
    assert slack.paths == [f"/services/{SLACK_TOKEN}"]
    text = message["text"]
    assert text.startswith("Fine-tune run failed at preflight: Preflight failed, no VM was created: ") and CAUSE in text
    assert "DAG: team_slack_job" in text and f"Run: {run_id}" in text
    assert f"/dags/team_slack_job/runs/{urllib.parse.quote(run_id, safe='')}" in text
    assert "The fine-tune did not complete" in text  # check_run_outcome's error, read from XCom by the processor


def test_the_mailbox_is_told_the_cause_and_the_runs_page(failed_runs):
    _, runs, _, smtp = failed_runs
    run_id = runs["team_mail_job"]["dag_run_id"]
    [mail] = smtp.wait_for(lambda m: run_id in body_text(m), timeout=NOTIFIED_WITHIN)
    assert mail["To"] == "ml-team@example.com" and mail["From"] == "airflow@example.com"
    assert mail["Subject"].startswith("[team_mail_job] Fine-tune run failed at preflight: Preflight failed, no VM")
    body = body_text(mail)
    assert CAUSE in body and f"/dags/team_mail_job/runs/{urllib.parse.quote(run_id, safe='')}" in body


def test_no_secret_reaches_the_logs(failed_runs):
    airflow, runs, slack, _ = failed_runs
    slack.wait_for(lambda m: True, timeout=NOTIFIED_WITHIN)
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


def test_the_janitor_command_asks_airflow_with_the_recipes_login_and_deletes_a_failed_runs_vm(failed_runs, local_cloud, tmp_path):
    """docs/reliability.md's janitor recipe, run as printed against this Airflow, whose users log in:
    a VM left by a run that failed (its teardown could not run) and one whose run this Airflow never
    had, both within their lifetime. Only Airflow's answers can condemn them."""
    airflow, runs, _, _ = failed_runs
    hook = ComputeEngineEndpointHook(gcp_conn_id="google_cloud_default")
    left = {}
    for name, (dag_id, run_id) in {
        "failed-run": ("team_slack_job", runs["team_slack_job"]["dag_run_id"]),
        "unknown-run": ("team_mail_job", "manual__never-ran"),
    }.items():
        spec = make_spec(run_id=f"{name}-{time.time_ns()}", project_id=LOCAL_PROJECT, reservation=LOCAL_RUN_CONF["reservation"])
        body = spec.instance_body()
        body["labels"][EXPIRY_LABEL] = str(int(time.time()) + 3600)
        metadata = {item["key"]: item for item in body["metadata"]["items"]}
        metadata["airflow-dag-id"]["value"], metadata["airflow-run-id"]["value"] = dag_id, run_id
        hook.insert_instance(body=body, zone=spec.zone, project_id=LOCAL_PROJECT)
        left[name] = spec.vm_name
    zone = spec.zone
    commands = recipe(REPO / "docs" / "reliability.md", "janitor-command")
    commands = commands.replace("PROJECT", LOCAL_PROJECT).replace("AIRFLOW_URL", airflow.url).replace("python ", f"{sys.executable} ")
    env = {**os.environ, "PYTHONPATH": str(REPO / "plugins"), "JANITOR_PASSWORD": "not the password"}
    env.pop("AIRFLOW_API_TOKEN", None)
    try:
        # A wrong password: Airflow refuses the login, its API then every read, and nothing is deleted.
        refused = subprocess.run(["bash", "-euo", "pipefail", "-c", commands], cwd=tmp_path, env=env,
                                 capture_output=True, text=True, timeout=120)
        assert refused.returncode == 0, refused.stderr
        assert "Airflow refused the login in janitor-login.json (401)" in refused.stderr, refused.stderr
        assert set(left.values()) <= {vm["name"] for vm in local_cloud.vms()}
        assert oct((tmp_path / "janitor-login.json").stat().st_mode & 0o777) == "0o600"
        # The right one: the failed run's VM and the unknown run's go, each for its reason.
        done = subprocess.run(["bash", "-euo", "pipefail", "-c", commands], cwd=tmp_path,
                              env={**env, "JANITOR_PASSWORD": JANITOR_PASSWORD}, capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr
        deleted = {vm["name"]: vm["reason"] for vm in json.loads(done.stdout.strip().splitlines()[-1])}
        assert set(deleted) == set(left.values()), done.stderr
        assert "is failed" in deleted[left["failed-run"]] and "no longer exists" in deleted[left["unknown-run"]], deleted
        assert JANITOR_PASSWORD not in done.stderr + done.stdout
    finally:
        for vm in local_cloud.vms():
            if vm["name"] in left.values():
                hook.delete_instance(resource_id=vm["name"], zone=zone, project_id=LOCAL_PROJECT)


@pytest.fixture
def dataset_history(local_cloud, pipeline_connections):
    """A commit at noon the day before each run's date: run N pins commit N."""
    seeded = local_cloud.hub.seed_repo(
        DATASET,
        repo_type="dataset",
        commits=[
            {"files": {"data/train_sft-00000-of-00001.parquet": f"chats of {day - timedelta(hours=12):%b %d}",
                       "data/test_sft-00000-of-00001.parquet": f"held-out chats of {day - timedelta(hours=12):%b %d}"},
             "date": (day - timedelta(hours=12)).isoformat()}
            for day in DAYS
        ],
    )
    return seeded["commits"]


def why_failed(airflow, runs) -> str:
    """Each failed run's task states and its first failed task's log tail (the assertion's message)."""
    report = []
    for run in runs:
        if run["state"] == "success":
            continue
        states = airflow.task_states(run["dag_run_id"], DAG_ID)
        report.append(f"{run['dag_run_id']}: {states}")
        failed = [task for task, state in states.items() if state == "failed" and task != "check_run_outcome"]
        for entry in airflow.task_log(run["dag_run_id"], failed[0], dag_id=DAG_ID) if failed else []:
            for error in entry.get("error_detail", []) if isinstance(entry, dict) else []:
                report.append(f"{failed[0]}: {error.get('exc_type')}: {error.get('exc_value')}")
    return "\n".join(report)


def vm_lifetimes(requests: list[dict], operations: list[dict]) -> dict[str, tuple[str, str | None]]:
    """VM name -> (accepted insert time, accepted delete time) from the compute emulator's request
    log. Only the insert whose operation made the VM counts (found by its requestId, the
    operation's clientOperationId): an insert refused on its operation, as when two waiting runs
    saw the same free machine and the other got it, made no VM."""
    made = {
        op.get("clientOperationId")
        for op in operations
        if op.get("operationType") == "insert" and op.get("status") == "DONE" and "error" not in op
    }
    lives: dict[str, list] = {}
    for entry in requests:
        if entry["status"] != 200:
            continue
        if entry["method"] == "POST" and entry["path"].endswith("/instances"):
            if (entry.get("query") or {}).get("requestId") in made:
                lives.setdefault(entry["body"]["name"], [entry["time"], None])
        elif entry["method"] == "DELETE" and "/instances/" in entry["path"]:
            name = entry["path"].rsplit("/", 1)[-1]
            if name in lives and lives[name][1] is None:
                lives[name][1] = entry["time"]
    return {name: tuple(life) for name, life in lives.items()}


def most_alive_at_once(lives) -> int:
    events = sorted([(start, 1) for start, _ in lives.values()] + [(end, -1) for _, end in lives.values() if end])
    alive = most = 0
    for _, change in events:  # at equal times the delete (-1) sorts first: it freed the unit
        alive += change
        most = max(most, alive)
    return most


def test_a_backfill_over_three_days_trains_each_on_its_snapshot_two_vms_at_a_time(
    jobs_airflow, dataset_history, local_cloud
):
    airflow, webhook = jobs_airflow.airflow, jobs_airflow.webhook
    local_cloud.add_reservation(RESERVATION, CAPACITY, zone="us-east5-b", project=LOCAL_PROJECT)
    dag = wait_until(lambda: airflow.get(f"/api/v2/dags/{DAG_ID}", missing_ok=True), 300, f"{DAG_ID} parsed")
    assert dag["is_paused"] is True  # a declared job spends nothing until someone unpauses it
    assert dag["max_active_runs"] == 1
    airflow.request("PATCH", f"/api/v2/dags/{DAG_ID}?update_mask=is_paused", {"is_paused": False})

    # A failed run (preflight: no such reservation) is told to the job's webhook.
    failing = airflow.request("POST", f"/api/v2/dags/{DAG_ID}/dagRuns",
                              {"logical_date": None, "conf": {"reservation": "no-such-reservation"}})["dag_run_id"]
    assert wait_for_run_end(airflow, failing, dag_id=DAG_ID)["state"] == "failed"
    [told] = webhook.wait_for(lambda m: m.get("run_id") == failing, timeout=NOTIFIED_WITHIN)
    assert told["dag_id"] == DAG_ID and told["event"] == "run_failed"

    local_cloud.clear_requests()
    airflow.cli("backfill", "create", "--dag-id", DAG_ID, "--from-date", "2026-11-01", "--to-date", "2026-11-03",
                "--max-active-runs", "4")

    def backfill_runs():
        runs = airflow.get(f"/api/v2/dags/{DAG_ID}/dagRuns?run_type=backfill&order_by=logical_date")["dag_runs"]
        return runs if len(runs) == len(DAYS) and all(r["state"] in ("success", "failed") for r in runs) else None

    runs = wait_until(backfill_runs, 1500, "the three backfill runs to end")
    assert [r["state"] for r in runs] == ["success"] * len(DAYS), why_failed(airflow, runs)
    assert [datetime.fromisoformat(r["logical_date"]) for r in runs] == DAYS

    specs = [airflow.xcom(r["dag_run_id"], "plan_run", "spec", dag_id=DAG_ID) for r in runs]
    # Each run pinned the commit current at its date, and trained on that commit's files.
    assert [spec["dataset_revision"] for spec in specs] == dataset_history
    assert all(spec["dataset_files"] == ["data/train_sft-00000-of-00001.parquet"] for spec in specs)
    assert len({spec["run_name"] for spec in specs}) == len({spec["vm_name"] for spec in specs}) == len(DAYS)

    # A run record per run, in its own run folder, each naming its own snapshot.
    storage = StorageEndpointHook(gcp_conn_id="google_cloud_default")
    for spec, revision in zip(specs, dataset_history):
        bucket, _, name = spec["output_location"].removeprefix("gs://").partition("/")
        record = json.loads(storage.download(bucket, f"{name}/runs/{spec['run_name']}/run-record.json"))
        assert record["dataset_revision"] == revision and record["run_name"] == spec["run_name"]
        assert record["dataset_files"] == ["data/train_sft-00000-of-00001.parquet"]

    # Never more VMs than the reservation holds; every VM deleted.
    lives = vm_lifetimes(local_cloud.requests(), compute_operations(local_cloud))
    assert set(lives) == {spec["vm_name"] for spec in specs}
    assert all(end is not None for _, end in lives.values()), lives
    assert most_alive_at_once(lives) == CAPACITY
    assert not [vm for vm in local_cloud.vms() if vm["name"] in lives]

    # Lineage: one tuned-model Asset event per run, with what made the model.
    events = airflow.get(f"/api/v2/assets/events?source_dag_id={DAG_ID}&order_by=timestamp")["asset_events"]
    extras = sorted((e["extra"] for e in events), key=lambda extra: extra["dataset_revision"])
    assert sorted(e["source_run_id"] for e in events) == sorted(r["dag_run_id"] for r in runs)
    assert sorted(dataset_history) == [extra["dataset_revision"] for extra in extras]
    for extra in extras:
        assert extra["location"].startswith("gs://") and extra["location"].endswith("/hf-export")
        assert extra["steps"] == 20 and float(extra["final_loss"]) > 0 and extra["base_model"] == "google/gemma-3-4b-it"
