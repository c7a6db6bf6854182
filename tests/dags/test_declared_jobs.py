"""Declared jobs: one YAML file per job, one loader per file, checked at parse time."""

from __future__ import annotations

import re
import textwrap

import pytest

from maxtext_sft.builders.jobs import JobConfigError, jobs_dir, load_job
from maxtext_sft.ui.notifier import OwnersNotifier
from tests.conftest import REPO

LOADER = 'from airflow.sdk import DAG\nfrom maxtext_sft.builders.jobs import declared_job_dag\ndag: DAG = declared_job_dag("{}")\n'
GOOD = {
    "schedule": "30 2 * * 1",
    "start_date": "2026-11-02",
    "params": {"reservation": "team-v6e", "steps": 20, "dataset_name": "team/chats"},
}


def write_job(folder, name, fields) -> None:
    import yaml

    (folder / name).write_text(yaml.safe_dump(fields) if isinstance(fields, dict) else fields)


def test_every_job_file_has_one_loader_and_every_loader_a_job_file():
    files = {path.name for path in (REPO / "include" / "jobs").glob("*.yaml")}
    assert files, "the project ships at least one example job"
    loaded = {}
    for loader in (REPO / "dags").glob("*.py"):
        for name in re.findall(r'declared_job_dag\("([^"]+)"\)', loader.read_text()):
            loaded.setdefault(name, []).append(loader.name)
    assert {name: len(loaders) for name, loaders in loaded.items()} == {name: 1 for name in files}


def test_the_example_job_is_a_paused_daily_dag_running_one_at_a_time_with_its_values():
    from airflow.dag_processing.dagbag import DagBag

    bag = DagBag(str(REPO / "dags"))
    assert bag.import_errors == {}
    job, manual = bag.dags["ultrachat_gemma3_nightly"], bag.dags["maxtext_sft"]
    assert job.timetable.expression == "0 0 * * *"  # "@daily"
    assert (job.max_active_runs, job.catchup, job.is_paused_upon_creation) == (1, False, True)
    # A job failing three nights in a row pauses itself; the manual DAG never does.
    assert (job.max_consecutive_failed_dag_runs, manual.max_consecutive_failed_dag_runs) == (3, 0)
    assert job.params["reservation"] == "nlp-team-v6e-8" and job.params["steps"] == 1000
    assert job.params["zone"] == manual.params["zone"]  # unset fields keep the tutorial's values
    assert sorted(job.task_dict) == sorted(manual.task_dict)  # the same pipeline
    assert isinstance(job.on_failure_callback, OwnersNotifier) and job.on_failure_callback.conn_id == "nlp_team_webhook"
    assert manual.on_failure_callback is None and manual.schedule is None
    # Its page shows the file as written and the value of every Param its runs get, and whence.
    assert (REPO / "include" / "jobs" / "ultrachat-gemma3-nightly.yaml").read_text().rstrip() in job.doc_md
    assert '| `reservation` | `"nlp-team-v6e-8"` | this file |' in job.doc_md
    assert '| `network` | `"default"` | default |' in job.doc_md
    assert job.doc_md.count("\n| `") == len(job.params)


def test_a_job_names_its_mail_recipients_in_its_notify_block(tmp_path):
    write_job(tmp_path, "team-job.yaml", {**GOOD, "notify": {"conn_id": "team_mail", "to": "ml-team@example.com"}})
    job = load_job(tmp_path / "team-job.yaml")
    assert (job["notify_conn_id"], job["notify_to"]) == ("team_mail", ["ml-team@example.com"])
    write_job(tmp_path, "team-job.yaml", {**GOOD, "notify": {"conn_id": "team_slack"}})
    assert load_job(tmp_path / "team-job.yaml")["notify_to"] == []


def test_a_job_may_turn_catchup_on_and_allow_more_runs(tmp_path):
    write_job(tmp_path, "wide.yaml", {**GOOD, "catchup": True, "max_active_runs": 3, "dag_id": "team_wide",
                                      "max_consecutive_failed_runs": 0})
    job = load_job(tmp_path / "wide.yaml")
    assert (job["dag_id"], job["catchup"], job["max_active_runs"]) == ("team_wide", True, 3)
    assert job["max_consecutive_failed_dag_runs"] == 0
    assert job["start_date"].isoformat() == "2026-11-02T00:00:00+00:00"


@pytest.mark.parametrize(
    ("fields", "field", "why"),
    [
        ({**GOOD, "params": {**GOOD["params"], "steps": 0}}, "params.steps", "0 is not an integer in [1, 10000000]"),
        ({**GOOD, "params": {**GOOD["params"], "zone": "mars"}}, "params.zone", "'mars' is not a zone"),
        ({**GOOD, "params": {**GOOD["params"], "stepz": 10}}, "params", "key 'stepz' is not a Param of this DAG; did you mean 'steps'?"),
        ({**GOOD, "params": {"steps": 10}}, "params.reservation", "required"),
        ({**GOOD, "params": {**GOOD["params"], "train_extra_args": ["steps=5"]}}, "params.train_extra_args", "set by the pipeline"),
        ({**GOOD, "params": {**GOOD["params"], "output_location": "s3://x"}}, "params.output_location", "is not a gs://bucket/prefix location"),
        ({**GOOD, "schedule": "every day"}, "schedule", "not a cron expression"),
        ({**GOOD, "schedule": "61 * * * *"}, "schedule", "not a cron expression"),
        ({k: v for k, v in GOOD.items() if k != "start_date"}, "start_date", "required"),
        ({**GOOD, "start_date": "yesterday"}, "start_date", "not an ISO date"),
        ({**GOOD, "max_active_runs": 0}, "max_active_runs", "integer in"),
        ({**GOOD, "catchup": "yes"}, "catchup", "true or false"),
        ({**GOOD, "max_consecutive_failed_runs": -1}, "max_consecutive_failed_runs", "integer in [0, 1000]"),
        ({**GOOD, "max_consecutive_failed_runs": True}, "max_consecutive_failed_runs", "integer in [0, 1000]"),
        ({**GOOD, "notify": {"url": "https://x"}}, "notify", "conn_id"),
        ({**GOOD, "notify": {"conn_id": "team_mail", "to": "not an address"}}, "notify.to", "not an email address"),
        ({**GOOD, "notify": {"conn_id": "team_mail", "to": ["a@example.com", 5]}}, "notify.to", "not an email address"),
        ({**GOOD, "notify": {"to": ["a@example.com"]}}, "notify.to", "need notify.conn_id"),
        ({**GOOD, "scheduel": "@daily"}, "scheduel", "unknown field"),
        ({**GOOD, "dag_id": "bad id!"}, "dag_id", "not a DAG id"),
    ],
)
def test_a_broken_field_is_named_with_its_file(tmp_path, fields, field, why):
    write_job(tmp_path, "team-job.yaml", fields)
    with pytest.raises(JobConfigError) as raised:
        load_job(tmp_path / "team-job.yaml")
    assert str(raised.value).startswith(f"team-job.yaml: field {field!r}: "), raised.value
    assert why in str(raised.value)


def test_a_broken_job_is_one_import_error_naming_file_and_field_and_hides_no_other_dag(tmp_path, monkeypatch):
    from airflow.dag_processing.dagbag import DagBag

    jobs, dags = tmp_path / "jobs", tmp_path / "dags"
    jobs.mkdir(), dags.mkdir()
    write_job(jobs, "good-one.yaml", GOOD)
    write_job(jobs, "good-two.yaml", {**GOOD, "schedule": "@weekly"})
    write_job(jobs, "broken.yaml", {**GOOD, "params": {**GOOD["params"], "steps": -5}})
    write_job(jobs, "not-yaml.yaml", "schedule: [unclosed\n")
    for name in ("good-one", "good-two", "broken", "not-yaml"):
        (dags / f"job_{name.replace('-', '_')}.py").write_text(LOADER.format(f"{name}.yaml"))
    (dags / "maxtext_sft.py").write_text((REPO / "dags" / "maxtext_sft.py").read_text())
    monkeypatch.setenv("MAXTEXT_SFT_JOBS_DIR", str(jobs))
    assert jobs_dir() == jobs

    bag = DagBag(str(dags))
    assert set(bag.dags) == {"good_one", "good_two", "maxtext_sft"}
    assert bag.dags["good_two"].timetable.expression == "0 0 * * 0"
    errors = {path.rsplit("/", 1)[-1]: text for path, text in bag.import_errors.items()}
    assert set(errors) == {"job_broken.py", "job_not_yaml.py"}
    assert "broken.yaml: field 'params.steps': -5 is not an integer in [1, 10000000]" in errors["job_broken.py"]
    assert "not-yaml.yaml: not readable YAML" in errors["job_not_yaml.py"]
    assert textwrap.shorten(errors["job_broken.py"], 2000)  # one readable error, not a silent skip


def test_a_job_that_names_a_slice_trains_on_it_and_must_name_an_output_location(tmp_path, monkeypatch):
    from maxtext_sft.builders.jobs import declared_job_dag

    monkeypatch.setenv("MAXTEXT_SFT_JOBS_DIR", str(tmp_path))
    sliced = {**GOOD, "params": {**GOOD["params"], "tpu_slice": "v6e-32", "output_location": "gs://team/sft"}}
    write_job(tmp_path, "big.yaml", sliced)
    dag = declared_job_dag("big.yaml")
    assert dag.params["tpu_slice"] == "v6e-32"
    assert dag.params["machine_type"] == "ct6e-standard-4t"  # a slice's hosts, unless the file says
    assert {"create_workload_policy", "create_instance_template", "create_slice", "delete_slice"} <= set(dag.task_ids)
    assert "create_vm" not in dag.task_ids

    write_job(tmp_path, "big.yaml", {**sliced, "params": {**sliced["params"], "output_location": None}})
    with pytest.raises(JobConfigError, match="field 'params.output_location': a v6e-32 slice needs one"):
        load_job(tmp_path / "big.yaml")
