"""What a finished run leaves behind: its model card, its run record, and the publishing gate.

Pure functions of the RunSpec and the training's result, so tests need neither Airflow nor a Hub.
"""

from __future__ import annotations

import json
import math
import posixpath
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from maxtext_sft.run.spec import RunSpec
from maxtext_sft.results.export_config import TEXT_ONLY_ARCHITECTURE
from maxtext_sft.results.training_metrics import TrainingMetrics

RUN_RECORD_NAME = "run-record.json"
MODEL_CARD_NAME = "README.md"
# Beside the run record: the training loss per step as a chart, and the run summary (summarize_run).
LOSS_CURVE_NAME = "loss-curve.png"
RUN_SUMMARY_NAME = "run-summary.json"

# An export's files. MaxText's to_huggingface (checkpoint_conversion/utils/utils.py, 0.2.2:
# SAFE_TENSORS_WEIGHTS_FILE, SAFE_TENSORS_INDEX_FILE, shard_checkpoint) writes one
# model.safetensors when the weights fit in DEFAULT_MAX_SHARD_SIZE (3 GiB), else the shards
# model-0000N-of-0000M.safetensors and the index whose weight_map names each tensor's shard:
# Gemma 3 4B (about 8.6 GB in bf16) is always sharded.
CONFIG_FILE = "config.json"
SINGLE_WEIGHTS_FILE = "model.safetensors"
WEIGHTS_INDEX_FILE = "model.safetensors.index.json"
SHARD_FILE = re.compile(r"model-\d{5}-of-\d{5}\.safetensors")


class ExportLayoutError(ValueError):
    """The export is not a complete model: the message names what is missing or inconsistent."""


@dataclass(frozen=True)
class ExportLayout:
    """A checked export: `single` (model.safetensors) or `sharded` (the index and its shards)."""

    layout: str
    weight_files: tuple[str, ...]  # the safetensors files that hold the weights, sorted

    def describe(self) -> str:
        if self.layout == "single":
            return f"`{SINGLE_WEIGHTS_FILE}`"
        return f"{len(self.weight_files)} safetensors shards, indexed by `{WEIGHTS_INDEX_FILE}`"


def _shards_named_by(index_text: str) -> set[str]:
    try:
        index = json.loads(index_text)
    except ValueError as error:
        raise ExportLayoutError(f"{WEIGHTS_INDEX_FILE} is not JSON: {error}") from None
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict) or not weight_map:
        raise ExportLayoutError(f"{WEIGHTS_INDEX_FILE} names no shard (its weight_map is missing or empty)")
    shards = set(weight_map.values())
    for shard in shards:
        # A loader joins the name to the export folder: it must stay inside it.
        if not isinstance(shard, str) or not shard or shard.startswith("/") or ".." in shard.split("/"):
            raise ExportLayoutError(f"{WEIGHTS_INDEX_FILE} names a shard outside the export: {shard!r}")
    return {posixpath.normpath(shard) for shard in shards}


def check_export_layout(sizes: Mapping[str, int], read_text: Callable[[str], str]) -> ExportLayout:
    """The layout of an export whose files (relative names) have the given sizes in bytes, or
    ExportLayoutError. `read_text(name)` reads one of those files (only the index is read).

    Complete means: a non-empty config.json, and either a non-empty model.safetensors or the
    index with every shard its weight_map names present and non-empty. Shard-named files the
    layout does not use (a stray shard, or shards beside a single file) and both layouts at once
    are refused too: they would be published with the model and leave its weights ambiguous.
    """
    if not sizes.get(CONFIG_FILE):
        raise ExportLayoutError(f"{CONFIG_FILE} is {'empty' if CONFIG_FILE in sizes else 'missing'}")
    shard_files = {name for name in sizes if SHARD_FILE.fullmatch(name)}
    if SINGLE_WEIGHTS_FILE in sizes and WEIGHTS_INDEX_FILE in sizes:
        raise ExportLayoutError(f"both {SINGLE_WEIGHTS_FILE} and {WEIGHTS_INDEX_FILE}: which one is the model?")
    if SINGLE_WEIGHTS_FILE in sizes:
        if not sizes[SINGLE_WEIGHTS_FILE]:
            raise ExportLayoutError(f"{SINGLE_WEIGHTS_FILE} is empty")
        if shard_files:
            raise ExportLayoutError(f"shards {sorted(shard_files)} beside {SINGLE_WEIGHTS_FILE}, with no index")
        return ExportLayout("single", (SINGLE_WEIGHTS_FILE,))
    if WEIGHTS_INDEX_FILE not in sizes:
        found = f" (found {sorted(shard_files)} without it)" if shard_files else ""
        raise ExportLayoutError(f"no weights: neither {SINGLE_WEIGHTS_FILE} nor {WEIGHTS_INDEX_FILE}{found}")
    named = _shards_named_by(read_text(WEIGHTS_INDEX_FILE))
    missing = sorted(name for name in named if name not in sizes)
    if missing:
        raise ExportLayoutError(f"the shards {missing} named by {WEIGHTS_INDEX_FILE} are missing")
    empty = sorted(name for name in named if not sizes[name])
    if empty:
        raise ExportLayoutError(f"the shards {empty} named by {WEIGHTS_INDEX_FILE} are empty")
    stray = sorted(shard_files - named)
    if stray:
        raise ExportLayoutError(f"the shards {stray} are not named by {WEIGHTS_INDEX_FILE}")
    return ExportLayout("sharded", tuple(sorted(named)))


def check_export_folder(folder: Path) -> ExportLayout:
    """check_export_layout on a local folder (its files, recursively)."""
    sizes = {path.relative_to(folder).as_posix(): path.stat().st_size for path in folder.rglob("*") if path.is_file()}
    return check_export_layout(sizes, lambda name: (folder / name).read_text(encoding="utf-8"))


class FinalLossError(ValueError):
    """The final loss forbids publishing: not a number, infinite, or above the threshold."""


def check_final_loss(final_loss: str | float | None, limit: float | None) -> float:
    """The final loss as a number, if it may be published; raises FinalLossError naming why not."""
    try:
        loss = float(final_loss)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        raise FinalLossError(f"the training reported no final loss ({final_loss!r})") from None
    if math.isnan(loss) or math.isinf(loss):
        raise FinalLossError(f"the final loss is {loss}: the training diverged")
    if limit is not None and loss > limit:
        raise FinalLossError(f"the final loss {loss} is above hub_max_final_loss={limit}")
    return loss


# The tuned model's eval result in the card's model-index (the Hub's metadata for results, which
# huggingface_hub's ModelCardData/EvalResult write and parse): the publishing gate reads the last
# published card's result back by these.
EVAL_TASK_TYPE = "text-generation"
EVAL_METRIC_TYPE = "loss"
EVAL_METRIC_NAME = "Held-out eval loss"


def eval_gate(
    spec: RunSpec, eval_loss: Mapping[str, float | None] | None, last_published: float | None
) -> str | None:
    """Why the tuned model must not be published on its evaluation, or None when it may be: its
    eval loss must be below the base model's and, when a model was published before to the same
    repo and branch on the same eval split (`last_published`, its eval loss), at least
    hub_min_eval_improvement below that one's. A run without eval_split is not gated."""
    if not spec.eval_split:
        return None
    base, tuned = (eval_loss or {}).get("base"), (eval_loss or {}).get("tuned")
    if tuned is None:
        return f"the tuned model's eval loss on {spec.eval_split} was not measured (its metrics hold no final evaluation)"
    if base is None:
        return (
            f"the base model's eval loss on {spec.eval_split} was not measured (the evaluation before the first "
            "step is missing from the metrics: lost with a VM that was recreated?)"
        )
    if tuned >= base:
        return f"the tuned model's eval loss {tuned:.4g} is not below the base model's {base:.4g} on {spec.eval_split}"
    margin = spec.hub_min_eval_improvement
    if last_published is not None and tuned > last_published - margin:
        return (
            f"the tuned model's eval loss {tuned:.4g} is not {margin:g} or more below {last_published:.4g}, the "
            f"eval loss of the model last published to {spec.hub_repo_id}@{spec.hub_branch} (Param "
            "hub_min_eval_improvement)"
        )
    return None


def published_eval_loss(card_text: str, spec: RunSpec) -> float | None:
    """The held-out eval loss a published model card reports in its model-index for this run's
    eval split of this dataset; None when it reports none (published before evaluation, or on
    another split or dataset: not comparable)."""
    from huggingface_hub import ModelCard  # imported when used: DAG files stay cheap to parse (docs/architecture.md)

    try:
        results = ModelCard(card_text).data.eval_results or []
    except ValueError:  # a card whose metadata is not valid YAML or model-index
        return None
    for result in results:
        if (
            result.metric_type == EVAL_METRIC_TYPE
            and result.dataset_type == spec.dataset_name
            and result.dataset_split == spec.eval_split
            and isinstance(result.metric_value, (int, float))
        ):
            return float(result.metric_value)
    return None


def hub_commit_title(spec: RunSpec) -> str:
    """The Hub commit's title; it names the DAG run, and publishing twice is recognised by it."""
    return f"Fine-tune from Airflow DAG run {spec.dag_id}/{spec.run_id} (generation {spec.generation})"


def _dataset_text(spec: RunSpec) -> str:
    if spec.hub_dataset:
        where = f"[{spec.dataset_name}](https://huggingface.co/datasets/{spec.dataset_name})"
        revision = f"revision `{spec.dataset_revision}`" if spec.dataset_revision else "revision not pinned"
    elif spec.bucket_dataset:
        where, revision = f"the folder `{spec.dataset_name}`", f"{len(spec.dataset_files)} file(s)"
    else:
        where, revision = f"the folder `{spec.dataset_name}` on the VM", "revision not pinned"
    return f"{where}, split `{spec.train_split}`, columns {', '.join(spec.train_data_columns)}, {revision}"


def model_card(
    spec: RunSpec,
    *,
    final_step: int | None,
    final_loss: str | float | None,
    export: ExportLayout | None = None,
    eval_loss: Mapping[str, float | None] | None = None,
    config_corrections: Sequence[Mapping[str, Any]] = (),
    architecture: str | None = None,
) -> str:
    """README.md of the exported model: Hub metadata in YAML front matter (with the tuned model's
    held-out eval loss as a model-index result), then the facts (`export`: the checked layout of
    the weights beside it; `eval_loss`: {"base": ..., "tuned": ...}; `config_corrections`: the
    export's config.json values corrected, results/export_config.py; `architecture`: the model
    class its config.json names)."""
    from huggingface_hub import EvalResult, ModelCardData  # imported when used: DAG files stay cheap to parse (docs/architecture.md)

    tuned = (eval_loss or {}).get("tuned")
    eval_results = None
    if spec.eval_split and tuned is not None:
        eval_results = [
            EvalResult(
                task_type=EVAL_TASK_TYPE,
                dataset_type=spec.dataset_name,
                dataset_name=spec.dataset_name,
                dataset_split=spec.eval_split,
                dataset_revision=spec.dataset_revision,
                metric_type=EVAL_METRIC_TYPE,
                metric_name=EVAL_METRIC_NAME,
                metric_value=tuned,
            )
        ]
    metadata = ModelCardData(
        model_name=spec.hub_repo_id or spec.run_name,  # model-index needs a name when it has results
        base_model=spec.base_model_id,
        license=spec.base_model_license,
        library_name="transformers",
        datasets=[spec.dataset_name] if spec.hub_dataset else None,
        tags=["maxtext", "sft", "airflow"],
        eval_results=eval_results,
        dataset_revision=spec.dataset_revision,
        maxtext_version=spec.maxtext_version,
    )
    base = f"`{spec.base_model_id}`" if spec.base_model_id else f"MaxText model `{spec.model_name}`"
    if spec.model_revision:
        base += f" at revision `{spec.model_revision}`"
    rows = [
        ("Base model", base),
        ("Dataset", _dataset_text(spec)),
        ("Steps", f"{final_step} of {spec.steps}"),
        ("Final loss", str(final_loss)),
        ("Held-out eval loss", _eval_text(spec, eval_loss)),
        ("Per-device batch size", str(spec.per_device_batch_size)),
        ("MaxText", spec.maxtext_version),
        ("TPU", f"{spec.machine_type} ({spec.tpu['accelerator_type']})"),
        ("MaxText run name", f"`{spec.run_name}`"),
        ("Airflow DAG run", f"`{spec.dag_id}` / `{spec.run_id}` (generation {spec.generation})"),
    ]
    if spec.output_location:
        rows.append(("Checkpoints", f"`{spec.checkpoints_dir}`"))
    if architecture:
        rows.append(("Architecture", _architecture_text(spec, architecture)))
    if export:
        rows.append(("Weights", export.describe()))
    if config_corrections:
        fixes = "; ".join(
            f"`{fix['field']}` {fix['was']!r} -> {fix['now']!r} ({fix['source']})" for fix in config_corrections
        )
        rows.append(("config.json corrected", f"MaxText {spec.maxtext_version} exported {fixes}"))
    table = "\n".join(f"| {name} | {value} |" for name, value in rows)
    return (
        f"---\n{metadata.to_yaml()}\n---\n\n"
        f"# {spec.hub_repo_id or spec.run_name}\n\n"
        f"Supervised fine-tune (SFT) of {base} with MaxText {spec.maxtext_version}, "
        f"{final_step} steps, final training loss {final_loss}.\n\n"
        "| | |\n|---|---|\n"
        f"{table}\n"
    )


def _architecture_text(spec: RunSpec, architecture: str) -> str:
    if architecture != TEXT_ONLY_ARCHITECTURE:
        return f"`{architecture}`"
    return (
        f"`{architecture}`, Gemma 3's text model: the fine-tune trained the language model alone "
        f"(`use_multimodal=False`), which MaxText {spec.maxtext_version} exports under the multimodal "
        "`Gemma3ForConditionalGeneration` config without its vision tower and projector (a loader would "
        "fill them at random). Published as the text model instead: its text config, the tensors "
        "`model.language_model.*` renamed `model.*`, every weight of the model in these files"
    )


def _eval_text(spec: RunSpec, eval_loss: Mapping[str, float | None] | None) -> str:
    if not spec.eval_split:
        return "not evaluated (Param eval_split empty)"

    def shown(value: float | None) -> str:
        return "not measured" if value is None else f"{value:.4f}"

    loss = eval_loss or {}
    return (
        f"base model {shown(loss.get('base'))}, tuned {shown(loss.get('tuned'))} "
        f"(split `{spec.eval_split}`, {spec.eval_steps} batches)"
    )


def run_record(
    spec: RunSpec,
    *,
    training: dict[str, Any],
    base_checkpoint: str | None,
    hf_export: str,
    location: str | None = None,
    metrics: TrainingMetrics | None = None,
    loss_curve: str | None = None,
    export: ExportLayout | None = None,
    config_corrections: Sequence[Mapping[str, Any]] = (),
    architecture: str | None = None,
) -> dict[str, Any]:
    """Where everything of the run went (written last, next to the run's outputs).

    `location` is where this record itself goes (the run summary points there); `metrics` the
    train and eval losses by step from MaxText's metrics file (None: it could not be read);
    `loss_curve` where their chart went; `export` the checked layout of the export;
    `config_corrections` what was corrected in its config.json; `architecture` the model class
    that config.json names.
    """
    final_step = training.get("final_step")
    return {
        "dag_id": spec.dag_id,
        "run_id": spec.run_id,
        "generation": spec.generation,
        "run_name": spec.run_name,
        "vm_name": spec.vm_name,
        # The data the run trained on: a Hub dataset's pinned commit and the files read at it.
        "dataset": spec.dataset_name,
        "dataset_revision": spec.dataset_revision,
        "dataset_files": list(spec.dataset_files),
        "final_step": final_step,
        "final_loss": training.get("final_loss"),
        # Held-out evaluation: the base model before the first step, the tuned one after the last.
        "eval_split": spec.eval_split,
        "eval_loss": metrics.eval_results(final_step) if metrics else {"base": None, "tuned": None},
        "vm_recoveries": training.get("vm_recoveries", 0),  # times the VM was lost and recreated
        "base_checkpoint": base_checkpoint,
        "checkpoints": spec.checkpoints_dir if spec.durable else None,
        "checkpoints_durable": spec.durable,
        "training_log": spec.training_log_uri,  # MaxText's full log, copied as the training exits
        "hf_export": hf_export,
        # "single" (model.safetensors) or "sharded" (model.safetensors.index.json and its shards)
        "hf_export_layout": export.layout if export else None,
        "hf_export_weight_files": list(export.weight_files) if export else None,
        # The model class published: Gemma3ForCausalLM for a text-only Gemma 3 fine-tune (export_to_hf.sh)
        "hf_export_architecture": architecture,
        # The export's config.json values corrected: [{field, was, now, source}] (results/export_config.py)
        "export_config_corrections": [dict(fix) for fix in config_corrections],
        "model_card": f"{hf_export}/{MODEL_CARD_NAME}",
        "run_record": location,
        "loss_curve": loss_curve,
        "loss_history": metrics.train if metrics else None,  # [[step, loss or None], ...]
        "eval_history": metrics.eval if metrics else None,
        "written_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
    }
