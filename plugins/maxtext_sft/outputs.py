"""What a finished run leaves behind: its model card, its run record, and the publishing gate.

Pure functions of the RunSpec and the training's result, so tests need neither Airflow nor a Hub.
"""

from __future__ import annotations

import math
from datetime import datetime, timezone
from typing import Any

from huggingface_hub import ModelCardData

from maxtext_sft.spec import RunSpec

RUN_RECORD_NAME = "run-record.json"
MODEL_CARD_NAME = "README.md"
# Beside the run record: the training loss per step as a chart, and the run summary (summarize_run).
LOSS_CURVE_NAME = "loss-curve.png"
RUN_SUMMARY_NAME = "run-summary.json"


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


def model_card(spec: RunSpec, *, final_step: int | None, final_loss: str | float | None) -> str:
    """README.md of the exported model: Hub metadata in YAML front matter, then the facts."""
    metadata = ModelCardData(
        base_model=spec.base_model_id,
        license=spec.base_model_license,
        library_name="transformers",
        datasets=[spec.dataset_name] if spec.hub_dataset else None,
        tags=["maxtext", "sft", "airflow"],
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
        ("Per-device batch size", str(spec.per_device_batch_size)),
        ("MaxText", spec.maxtext_version),
        ("TPU", f"{spec.machine_type} ({spec.tpu['accelerator_type']})"),
        ("MaxText run name", f"`{spec.run_name}`"),
        ("Airflow DAG run", f"`{spec.dag_id}` / `{spec.run_id}` (generation {spec.generation})"),
    ]
    if spec.output_location:
        rows.append(("Checkpoints", f"`{spec.checkpoints_dir}`"))
    table = "\n".join(f"| {name} | {value} |" for name, value in rows)
    return (
        f"---\n{metadata.to_yaml()}\n---\n\n"
        f"# {spec.hub_repo_id or spec.run_name}\n\n"
        f"Supervised fine-tune (SFT) of {base} with MaxText {spec.maxtext_version}, "
        f"{final_step} steps, final training loss {final_loss}.\n\n"
        "| | |\n|---|---|\n"
        f"{table}\n"
    )


def run_record(
    spec: RunSpec,
    *,
    training: dict[str, Any],
    base_checkpoint: str | None,
    hf_export: str,
    location: str | None = None,
    loss_history: list | None = None,
    loss_curve: str | None = None,
) -> dict[str, Any]:
    """Where everything of the run went (written last, next to the run's outputs).

    `location` is where this record itself goes (the run summary points there); `loss_history`
    is [[step, loss or None], ...] from the training log (None: it could not be read);
    `loss_curve` where its chart went.
    """
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
        "final_step": training.get("final_step"),
        "final_loss": training.get("final_loss"),
        "vm_recoveries": training.get("vm_recoveries", 0),  # times the VM was lost and recreated
        "base_checkpoint": base_checkpoint,
        "checkpoints": spec.checkpoints_dir if spec.durable else None,
        "checkpoints_durable": spec.durable,
        "hf_export": hf_export,
        "model_card": f"{hf_export}/{MODEL_CARD_NAME}",
        "run_record": location,
        "loss_curve": loss_curve,
        "loss_history": loss_history,
        "written_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
    }
