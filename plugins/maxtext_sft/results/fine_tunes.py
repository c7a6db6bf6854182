"""What the Fine-tunes page shows of one run, and the Cloud console / Hub addresses of its outputs.

Pure functions of the XComs a run leaves (plan_run's spec, collect_outputs' run record,
publish_to_hub's result, summarize_run's summary), so tests need no Airflow. Every key is read
defensively: runs from before a key existed show "-" for it.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any
from urllib.parse import quote

from maxtext_sft.results.summary import capacity_wait_text
from maxtext_sft.run.names import split_gcs_uri

# fine_tune_dag tags every DAG it builds with this: the page finds the fine-tune DAGs by it.
FINE_TUNE_TAG = "fine-tune"

# The tasks whose return values the page reads (task ids of pipeline.fine_tune_dag).
PLAN_TASK, OUTPUTS_TASK, PUBLISH_TASK, SUMMARY_TASK = "plan_run", "collect_outputs", "publish_to_hub", "summarize_run"
PLAN_SPEC_KEY = "spec"  # plan_run has multiple_outputs: the spec is its own XCom too

CONSOLE = "https://console.cloud.google.com"
HUB = "https://huggingface.co"
NOTHING = "-"


def vm_console_url(project: str, zone: str, name: str) -> str:
    return f"{CONSOLE}/compute/instancesDetail/zones/{quote(zone)}/instances/{quote(name)}?project={quote(project)}"


def split_gs_uri(uri: Any) -> tuple[str, str] | None:
    """(bucket, path) of gs://BUCKET/PATH; None for anything else (a worker's folder, "-")."""
    if not isinstance(uri, str) or not uri.startswith("gs://"):
        return None
    bucket, path = split_gcs_uri(uri)
    return (bucket, path) if bucket else None


def storage_folder_console_url(uri: Any) -> str | None:
    """The console's browser on a gs:// folder; None when `uri` is not in Cloud Storage."""
    where = split_gs_uri(uri)
    if where is None:
        return None
    bucket, prefix = where
    return f"{CONSOLE}/storage/browser/{quote(bucket)}/{quote(prefix)}".rstrip("/")


def storage_object_console_url(uri: Any) -> str | None:
    """The console's page of one gs:// object; None when `uri` is not in Cloud Storage."""
    where = split_gs_uri(uri)
    if where is None or not where[1]:
        return None
    bucket, name = where
    return f"{CONSOLE}/storage/browser/_details/{quote(bucket)}/{quote(name)}"


def run_folder_uri(record: Mapping[str, Any] | None) -> str | None:
    """The run's own folder: where its run record lies (gs://... or a worker's path)."""
    location = (record or {}).get("run_record")
    if not isinstance(location, str) or "/" not in location:
        return None
    return location.rsplit("/", 1)[0]


def hub_commit_url(repo_id: Any, commit: Any) -> str | None:
    if not (isinstance(repo_id, str) and repo_id and isinstance(commit, str) and commit):
        return None
    return f"{HUB}/{quote(repo_id)}/commit/{quote(commit)}"


def published_commit(published: Mapping[str, Any] | None) -> tuple[str, str] | None:
    """(repo_id, commit) when publish_to_hub's result says it published: the old result
    ({repo_id, branch, commit, url}) or the new one ({"published": true, ...})."""
    if not isinstance(published, Mapping) or published.get("published") is False:
        return None
    repo_id, commit = published.get("repo_id"), published.get("commit")
    return (repo_id, commit) if isinstance(repo_id, str) and isinstance(commit, str) and commit else None


@dataclass(frozen=True)
class Link:
    text: str
    url: str | None  # None: shown as text (a worker's path has no address)


@dataclass(frozen=True)
class FineTuneRow:
    dag_id: str
    run_id: str
    state: str
    logical_date: str
    dataset: str
    steps: str
    train_loss: str
    eval_loss: str
    vm: str
    published: Link
    outputs: list[Link] = field(default_factory=list)
    has_loss_plot: bool = False
    cause: str = ""  # a failed run's note (ui/run_notes.py: the first failed task and its error)


def _number(value: Any) -> float | None:
    try:
        number = float(value)
    except (TypeError, ValueError):
        return None
    return number


def _loss(value: Any) -> str:
    """A loss as text: 4 significant digits; "nan"/"inf" as such (a diverged run); "-" when absent."""
    number = _number(value)
    if number is None:
        return NOTHING
    return str(number) if not math.isfinite(number) else f"{number:.4g}"


def _when(value: datetime | None) -> str:
    return f"{value:%Y-%m-%d %H:%M} UTC" if value else NOTHING


def _dataset(record: Mapping[str, Any], spec: Mapping[str, Any]) -> str:
    name = record.get("dataset") or spec.get("dataset_name")
    if not name:
        return NOTHING
    revision = record.get("dataset_revision") if "dataset_revision" in record else spec.get("dataset_revision")
    return f"{name} @ {revision[:12]}" if isinstance(revision, str) and revision else f"{name} (revision not pinned)"


def _steps(record: Mapping[str, Any], spec: Mapping[str, Any]) -> str:
    final, planned = record.get("final_step"), spec.get("steps")
    if final is not None and planned is not None:
        return f"{final} of {planned}"
    return str(final if final is not None else planned if planned is not None else NOTHING)


def _eval_loss(record: Mapping[str, Any]) -> str:
    evals = record.get("eval_loss")
    if not isinstance(evals, Mapping) or (evals.get("base") is None and evals.get("tuned") is None):
        return NOTHING
    return f"{_loss(evals.get('base'))} → {_loss(evals.get('tuned'))}"


def _vm(summary: Mapping[str, Any]) -> str:
    """The billed VM-hours and their cost; then, apart, a wait for capacity (not billed) and the
    Spot preemptions, when there were any."""
    vm = summary.get("vm")
    if not isinstance(vm, Mapping):
        return NOTHING
    hours, cost = _number(vm.get("vm_hours")), _number(vm.get("estimated_cost_usd"))
    if hours is None:
        return NOTHING
    parts = [f"{hours:.3f} h, ${cost:.2f}" if cost is not None else f"{hours:.3f} h"]
    if wait := capacity_wait_text(_number(vm.get("waited_for_capacity_seconds"))):
        parts.append(wait)
    preemptions = summary.get("preemptions")
    if isinstance(preemptions, int) and preemptions > 0:
        parts.append(f"{preemptions} preemption{'s' if preemptions > 1 else ''}")
    return "; ".join(parts)


def _published(published: Any, publish_state: str | None) -> Link:
    if commit := published_commit(published if isinstance(published, Mapping) else None):
        repo_id, sha = commit
        return Link(f"{repo_id} @ {sha[:10]}", hub_commit_url(repo_id, sha))
    if isinstance(published, Mapping) and published.get("reason"):
        return Link(f"not published: {published['reason']}", None)
    if publish_state == "success":
        return Link("not published: no hub_repo_id", None)  # the old result: None when it was not set
    if publish_state in ("failed", "upstream_failed", "skipped", "removed"):
        return Link(f"not published: publish_to_hub {publish_state.replace('_', ' ')}", None)
    return Link(f"not yet ({publish_state})" if publish_state else NOTHING, None)


def _outputs(record: Mapping[str, Any], run_page: str) -> list[Link]:
    links = []
    for text, key, url_of in (
        ("run record", "run_record", storage_object_console_url),
        ("export", "hf_export", storage_folder_console_url),
        ("model card", "model_card", storage_object_console_url),
    ):
        if isinstance(location := record.get(key), str) and location:
            # Outside Cloud Storage (a worker's folder) the path itself is shown: it has no address.
            links.append(Link(text, url_of(location)) if split_gs_uri(location) else Link(f"{text}: {location}", None))
    links.append(Link("run in Airflow", run_page))
    return links


def loss_plot_series(record: Mapping[str, Any] | None) -> tuple[list, list]:
    """(loss_history, eval_history) of a run record: [[step, loss], ...] each, [] when absent."""
    record = record if isinstance(record, Mapping) else {}
    history, evals = record.get("loss_history"), record.get("eval_history")
    return (history if isinstance(history, list) else []), (evals if isinstance(evals, list) else [])


def fine_tune_row(
    *,
    dag_id: str,
    run_id: str,
    state: str | None,
    logical_date: datetime | None,
    run_after: datetime | None,
    run_page: str,
    spec: Any = None,
    record: Any = None,
    published: Any = None,
    summary: Any = None,
    publish_state: str | None = None,
    note: str | None = None,
) -> FineTuneRow:
    """One row of the page from a run's identity and the return values its tasks left (None:
    the task left none). `run_page` is the run's address in Airflow's UI; `note` the run's note,
    shown as the cause of a failed run (what its failure listener wrote, or a person's note)."""
    spec = spec if isinstance(spec, Mapping) else {}
    record = record if isinstance(record, Mapping) else {}
    summary = summary if isinstance(summary, Mapping) else {}
    # A manual run has no logical date: its row shows when it was triggered instead.
    when = _when(logical_date) if logical_date else f"{NOTHING} (triggered {_when(run_after)})"
    return FineTuneRow(
        dag_id=dag_id,
        run_id=run_id,
        state=state or NOTHING,
        logical_date=when,
        dataset=_dataset(record, spec),
        steps=_steps(record, spec),
        train_loss=_loss(record.get("final_loss", summary.get("final_loss"))),
        eval_loss=_eval_loss(record),
        vm=_vm(summary),
        published=_published(published, publish_state),
        outputs=_outputs(record, run_page),
        has_loss_plot=bool(loss_plot_series(record)[0]),
        cause=note.strip() if state == "failed" and isinstance(note, str) else "",
    )
