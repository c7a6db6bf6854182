"""Declared jobs: a team's fine-tune as one small YAML file, run on its schedule.

include/jobs/NAME.yaml declares the job (see include/jobs/README.md for the fields);
dags/job_NAME.py, a few lines (a copy of dags/job_ultrachat_gemma3_nightly.py), turns it into a DAG with `declared_job_dag("NAME.yaml")`. One
loader per file because Airflow records import errors per Python file: a broken config shows
in the UI as that loader's import error, naming the file and the field, and hides no other job.

Everything is checked here, at parse time, from the file alone (no network, no database):
the schedule, the dates, the notification connection's name, and every Param through the same
check a run makes (`spec.build_run_spec`, from the Params' one declaration in run/params.py).
"""

from __future__ import annotations

import datetime as dt
import json
import os
import re
from pathlib import Path
from typing import Any

import pendulum
import yaml

from airflow.sdk import DAG
from maxtext_sft.ui.notifier import OwnersNotifier
from maxtext_sft.run.dag_params import pipeline_params, with_defaults
from maxtext_sft.run.paths import include_dir, packaged_include_dir
from maxtext_sft.builders.pipeline import fine_tune_dag
from maxtext_sft.run.params import SLICE_DEFAULTS, SpecError
from maxtext_sft.run.spec import build_run_spec

FIELDS = {
    "dag_id", "description", "owner", "tags", "schedule", "start_date", "end_date", "catchup",
    "max_active_runs", "max_consecutive_failed_runs", "notify", "params",
}
DAG_ID = re.compile(r"^[A-Za-z0-9_.-]{1,200}$")
CONN_ID = re.compile(r"^[A-Za-z0-9_.-]{1,250}$")
# An email address as SMTP takes it: one @, no spaces or angle brackets (the server checks the rest).
EMAIL = re.compile(r"^[^@\s<>,;]+@[^@\s<>,;]+\.[^@\s<>,;]+$")
SCHEDULE_PRESETS = {"@once", "@continuous", "@hourly", "@daily", "@weekly", "@monthly", "@quarterly", "@yearly"}


class JobConfigError(ValueError):
    """A declared job's file cannot make a DAG; the message names the file and the field."""


DEFAULT_MAX_CONSECUTIVE_FAILED_RUNS = 3
EXAMPLE_NOTE = "The package's example job."


def jobs_dir() -> Path:
    """The team's folder of jobs: MAXTEXT_SFT_JOBS_DIR (Composer's data/jobs, MWAA's dags/jobs, the
    tests' own jobs), else include/jobs (beside plugins/ in an Astro or compose project, or in
    MAXTEXT_SFT_INCLUDE_DIR). An installed wheel with neither set has only the package's example
    jobs there (is_package_examples)."""
    override = os.environ.get("MAXTEXT_SFT_JOBS_DIR")
    return Path(override) if override else include_dir() / "jobs"


def is_package_examples(folder: Path) -> bool:
    """Whether `folder` is the example jobs the wheel carries as package data: a deployment that
    copied every DAG file but set no folder of its own gets the example, paused and saying so,
    rather than an import error."""
    return folder.resolve() == (packaged_include_dir() / "jobs").resolve()


def load_job(path: Path) -> dict[str, Any]:
    """The job's fields, checked; raises JobConfigError naming the file and the field."""
    def bad(field: str, why: str) -> JobConfigError:
        return JobConfigError(f"{path.name}: field {field!r}: {why}")

    try:
        job = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as error:
        raise JobConfigError(f"{path.name}: not readable YAML: {error}") from None
    if not isinstance(job, dict):
        raise JobConfigError(f"{path.name}: expected a mapping of fields, got {type(job).__name__}")
    unknown = sorted(set(job) - FIELDS)
    if unknown:
        raise bad(unknown[0], f"unknown field (known: {', '.join(sorted(FIELDS))})")
    dag_id = job.get("dag_id", path.stem.replace("-", "_"))
    if not isinstance(dag_id, str) or not DAG_ID.fullmatch(dag_id):
        raise bad("dag_id", f"{dag_id!r} is not a DAG id (letters, digits, _ . -)")
    schedule = job.get("schedule")
    if not isinstance(schedule, str) or not (schedule in SCHEDULE_PRESETS or _is_cron(schedule)):
        raise bad("schedule", f"{schedule!r} is not a cron expression or one of {sorted(SCHEDULE_PRESETS)}")
    start_date = _date(job.get("start_date"), lambda why: bad("start_date", why), required=True)
    end_date = _date(job.get("end_date"), lambda why: bad("end_date", why), required=False)
    catchup = job.get("catchup", False)
    if not isinstance(catchup, bool):
        raise bad("catchup", f"{catchup!r} is not true or false")
    max_active_runs = job.get("max_active_runs", 1)
    if isinstance(max_active_runs, bool) or not isinstance(max_active_runs, int) or not 1 <= max_active_runs <= 64:
        raise bad("max_active_runs", f"{max_active_runs!r} is not an integer in [1, 64]")
    # A job failing night after night (a revoked token, a deleted reservation) pauses itself after
    # this many failed runs in a row (Airflow's max_consecutive_failed_dag_runs): it stops paying
    # for VMs until someone fixes it and unpauses it. 0: never.
    failed_runs = job.get("max_consecutive_failed_runs", DEFAULT_MAX_CONSECUTIVE_FAILED_RUNS)
    if isinstance(failed_runs, bool) or not isinstance(failed_runs, int) or not 0 <= failed_runs <= 1000:
        raise bad("max_consecutive_failed_runs", f"{failed_runs!r} is not an integer in [0, 1000]")
    notify = job.get("notify") or {}
    if not isinstance(notify, dict) or set(notify) - {"conn_id", "to"}:
        raise bad("notify", "expected {conn_id: <a Slack webhook, SMTP or HTTP connection>, to: [<email>, ...]}")
    if "conn_id" in notify and not (isinstance(notify["conn_id"], str) and CONN_ID.fullmatch(notify["conn_id"])):
        raise bad("notify.conn_id", f"{notify['conn_id']!r} is not a connection id")
    # The recipients of an SMTP connection's mail. The connection's type is known only when a
    # message is sent (no connection lookup at parse time), so `to` is checked here for its form.
    to = notify.get("to", [])
    to = [to] if isinstance(to, str) else to
    if not isinstance(to, list) or not all(isinstance(address, str) and EMAIL.fullmatch(address) for address in to):
        raise bad("notify.to", f"{notify.get('to')!r} is not an email address or a list of them")
    if to and "conn_id" not in notify:
        raise bad("notify.to", "recipients need notify.conn_id, the SMTP connection that sends the mail")
    tags = job.get("tags", [])
    if not isinstance(tags, list) or not all(isinstance(tag, str) and tag for tag in tags):
        raise bad("tags", "expected a list of strings")
    return {
        "dag_id": dag_id,
        "description": str(job.get("description") or f"Declared fine-tune {path.name}"),
        "owner": str(job.get("owner") or "ml-platform"),
        "tags": ["maxtext", "sft", "declared-job", *tags],
        "schedule": schedule,
        "start_date": start_date,
        "end_date": end_date,
        "catchup": catchup,
        "max_active_runs": max_active_runs,
        "max_consecutive_failed_dag_runs": failed_runs,
        "notify_conn_id": notify.get("conn_id"),
        "notify_to": to,
        "params": _params(job.get("params"), dag_id, lambda field, why: bad(field, why)),
    }


def _is_cron(expression: str) -> bool:
    from croniter import croniter  # Airflow's own cron parser

    return len(expression.split()) in (5, 6) and croniter.is_valid(expression)


def _date(value: Any, bad, *, required: bool) -> pendulum.DateTime | None:
    if value is None:
        if required:
            raise bad("required (the first interval; backfills cannot go before it)")
        return None
    if isinstance(value, str):
        try:
            value = dt.datetime.fromisoformat(value)
        except ValueError:
            raise bad(f"{value!r} is not an ISO date") from None
    if isinstance(value, dt.date) and not isinstance(value, dt.datetime):
        value = dt.datetime(value.year, value.month, value.day)
    if not isinstance(value, dt.datetime):
        raise bad(f"{value!r} is not a date")
    return pendulum.instance(value, tz="UTC") if value.tzinfo is None else pendulum.instance(value)


def _params(values: Any, dag_id: str, bad) -> dict[str, Any]:
    """The job's Params: its values checked as a run checks them (the run's own identity aside).
    A job that names a `tpu_slice` runs on a multi-host slice (its hosts' machine type by default)."""
    if not isinstance(values, dict):
        raise bad("params", "expected a mapping of Param names to values")
    tpu_slice = "tpu_slice" in values
    if tpu_slice:
        values = {**SLICE_DEFAULTS, **values}
    try:
        build_run_spec(
            values,
            dag_id=dag_id,
            run_id="parse-time-check",
            generation=0,
            started=dt.datetime(2000, 1, 1, tzinfo=dt.timezone.utc),
            default_project_id="project-of-the-connection",  # the real one is read at run time
            ssh_user="parse-time-check",
            ssh_public_key="ssh-ed25519 AAAA",
            tpu_slice=tpu_slice,
        )
    except SpecError as error:
        if error.param:
            raise bad(f"params.{error.param}", str(error).removeprefix(f"Param {error.param!r}: ")) from None
        raise bad("params", str(error)) from None
    return with_defaults(pipeline_params(tpu_slice=tpu_slice), values)


# A job file's fields that fine_tune_dag takes as they are.
JOB_DAG_FIELDS = (
    "params", "schedule", "start_date", "end_date", "catchup", "max_active_runs", "max_consecutive_failed_dag_runs",
    "description", "tags", "owner",
)


def declared_job_dag(file_name: str) -> DAG:
    """The DAG of include/jobs/`file_name`; raises JobConfigError (the loader's import error)."""
    folder = jobs_dir()
    path = folder / file_name
    if not path.is_file():
        raise JobConfigError(
            f"{file_name}: no such job in {folder} (the folder of jobs: MAXTEXT_SFT_JOBS_DIR, else include/jobs): "
            f"put the file there, or remove this loader"
        )
    job = load_job(path)
    example = is_package_examples(folder)
    if example:
        job = {**job, "description": f"{EXAMPLE_NOTE} {job['description']}", "tags": [*job["tags"], "example"]}
    notifier = OwnersNotifier(job["notify_conn_id"], to=job["notify_to"]) if job["notify_conn_id"] else None
    return fine_tune_dag(
        job["dag_id"],
        **{field: job[field] for field in JOB_DAG_FIELDS},
        # A new job spends nothing until someone unpauses it (whatever dags_are_paused_at_creation says).
        is_paused_upon_creation=True,
        on_failure_callback=notifier,
        tpu_slice="tpu_slice" in job["params"],
        doc_md=job_doc(path, job, example=example),
    )


def job_doc(path: Path, job: dict[str, Any], *, example: bool = False) -> str:
    """The job DAG's docs: its file as written, then every value its runs get (the file's, else
    the tutorial's), so the DAG's page answers "what does this job run" without the Params schema."""
    file_params = (yaml.safe_load(path.read_text()) or {}).get("params") or {}
    rows = "\n".join(
        f"| `{name}` | `{json.dumps(param.value if hasattr(param, 'value') else param, default=str)}` | "
        f"{'this file' if name in file_params else 'default'} |"
        for name, param in job["params"].items()
    )
    schedule = job["schedule"]
    note = (
        f"**{EXAMPLE_NOTE}** No folder of the team's own jobs is set: set `MAXTEXT_SFT_JOBS_DIR` to it "
        f"(docs/deployment.md), or remove this DAG's file from the DAGs folder.\n\n"
        if example else ""
    )
    return (
        f"{note}Declared job `{path.name}` in `{path.parent}`, running the fine-tune of plugins/maxtext_sft/builders/pipeline.py "
        f"on the schedule `{schedule}` (at most {job['max_active_runs']} run(s) at once; pauses itself after "
        f"{job['max_consecutive_failed_dag_runs'] or 'no number of'} failed runs in a row).\n\n"
        f"```yaml\n{path.read_text().rstrip()}\n```\n\n"
        f"| Param | value | from |\n|---|---|---|\n{rows}\n"
    )


def notify_targets() -> dict[str, dict[str, Any]]:
    """dag_id -> {"conn_id", "to"}: the notification target of every declared job (for the
    janitor); broken files skipped."""
    targets = {}
    for path in sorted(jobs_dir().glob("*.yaml")):
        try:
            job = load_job(path)
        except JobConfigError:
            continue  # its loader shows the import error
        if job["notify_conn_id"]:
            targets[job["dag_id"]] = {"conn_id": job["notify_conn_id"], "to": job["notify_to"]}
    return targets
