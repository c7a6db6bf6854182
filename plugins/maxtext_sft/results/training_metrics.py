"""The training's metrics as MaxText writes them for machines: its metrics file, JSON lines.

MaxText 0.2.2's MetricLogger.write_metrics_locally (common/metric_logger.py) appends one line per
write: the scalars by name, "step" (a float) and "run_name". SFT's hooks (trainers/post_train/
hooks.py) write "learning/loss" after each training step and "eval/avg_loss" after each
evaluation; with eval_interval = steps, Tunix evaluates before the first step (step 0: the base
model) and after the last (the tuned model). Pure functions (no Airflow).
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Iterable

from maxtext_sft.results.loss_curve import LossHistory, downsample

TRAIN_LOSS = "learning/loss"
EVAL_LOSS = "eval/avg_loss"


@dataclasses.dataclass(frozen=True)
class TrainingMetrics:
    """[[step, loss or None], ...] by step, for the training steps and the evaluations."""

    train: LossHistory
    eval: LossHistory

    def eval_loss_at(self, step: int) -> float | None:
        return next((loss for at, loss in self.eval if at == step), None)

    def eval_results(self, final_step: int | None) -> dict[str, float | None]:
        """The base model's eval loss (the evaluation before the first step) and the tuned
        model's (after the final step); None where that evaluation is not in the metrics (a run
        resumed on a new VM lost the first VM's file, a run without evaluation has none)."""
        return {"base": self.eval_loss_at(0), "tuned": self.eval_loss_at(final_step) if final_step else None}


def _number(value) -> float | None:
    """A loss as a finite float; None for NaN, infinity or anything else (JSON has no NaN, and a
    chart cannot place it)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value) if math.isfinite(value) else None


def parse_metrics(lines: Iterable[str]) -> TrainingMetrics:
    """The train and eval losses by step from metrics-file lines. A step written twice (a training
    resumed on the same VM appends to the file and trains some steps again) keeps its last value;
    lines that are not JSON objects with a numeric step are skipped (a line cut by a crash)."""
    train: dict[int, float | None] = {}
    evals: dict[int, float | None] = {}
    for line in lines:
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if not isinstance(record, dict) or _number(record.get("step")) is None:
            continue
        step = int(record["step"])
        if TRAIN_LOSS in record:
            train[step] = _number(record[TRAIN_LOSS])
        if EVAL_LOSS in record:
            evals[step] = _number(record[EVAL_LOSS])
    return TrainingMetrics(
        train=downsample([[step, train[step]] for step in sorted(train)]),
        eval=[[step, evals[step]] for step in sorted(evals)],
    )
