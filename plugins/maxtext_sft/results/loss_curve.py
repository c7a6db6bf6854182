"""The training's loss per step: read from MaxText's log lines (the training sensor's progress and
final loss), thinned for the run record, and drawn with the eval loss as a PNG (matplotlib).

Pure functions (no Airflow), so tests need neither a VM nor a scheduler.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable

# MaxText's per-step metrics line; the fast stand-in writes the same:
#   "completed step: 12, seconds: 0.01, ..., total_weights: 204, loss: 1.234, lm_loss: 0.000, ..."
# The first "loss:" after a space or comma is the step's loss (not lm_loss, which SFT leaves at 0).
STEP_LINE = re.compile(r"completed step: (\d+),.*?[ ,]loss: ([^ ,]+)")

# At most this many points go into the run record (and its XCom): enough for any chart.
MAX_POINTS = 2000

LossHistory = list[list]  # [[step, loss or None], ...]: None where the loss was NaN or infinite


def parse_loss_history(lines: Iterable[str]) -> LossHistory:
    """[[step, loss], ...] by step from "completed step" lines; a step logged twice (a training
    restarted from its checkpoint trains it again) keeps its last loss. A NaN or infinite loss
    becomes None: JSON has no such numbers, and a chart cannot place them."""
    losses: dict[int, float | None] = {}
    for line in lines:
        if match := STEP_LINE.search(line):
            try:
                loss: float | None = float(match.group(2))
            except ValueError:
                continue
            losses[int(match.group(1))] = loss if math.isfinite(loss) else None
    return [[step, losses[step]] for step in sorted(losses)]


def final_loss_text(lines: Iterable[str], final_step: int) -> str | None:
    """The loss of step `final_step` as MaxText printed it ("nan" stays "nan", for the publishing
    gate), from "completed step" lines; None when no line is of that step."""
    loss = None
    for line in lines:
        if (match := STEP_LINE.search(line)) and int(match.group(1)) == final_step:
            loss = match.group(2)
    return loss


def downsample(history: LossHistory, limit: int = MAX_POINTS) -> LossHistory:
    """At most `limit` evenly spaced points, the first and the last always among them."""
    if len(history) <= limit:
        return history
    last = len(history) - 1
    picks = sorted({round(i * last / (limit - 1)) for i in range(limit)})
    return [history[i] for i in picks]


def render_loss_curve(history: LossHistory, eval_history: LossHistory | None = None) -> bytes:
    """A PNG of the training loss (and the held-out eval loss, when measured) against the step,
    drawn by matplotlib; a NaN loss (None) breaks the line."""
    # Imported when drawn: DAG files and task processes that draw nothing stay cheap to start.
    import io

    from matplotlib.figure import Figure  # a Figure of its own: no pyplot global state, no GUI backend

    figure = Figure(figsize=(6.4, 4.0), dpi=100, layout="constrained")
    axes = figure.add_subplot()

    def plot(points: LossHistory, **style) -> None:
        steps = [step for step, _ in points]
        losses = [math.nan if loss is None else loss for _, loss in points]
        lone = len(points) == 1 or all(loss is None for loss in losses[1:])
        axes.plot(steps, losses, marker="o" if lone or style.pop("markers", False) else None, **style)

    plot(history, label="training loss", color="tab:blue", linewidth=1.5)
    if eval_history:
        plot(eval_history, label="held-out eval loss", color="tab:orange", linewidth=1.5, markers=True)
    axes.set_xlabel("step")
    axes.set_ylabel("loss")
    axes.grid(True, color="0.9")
    axes.legend(loc="upper right")
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png")
    return buffer.getvalue()
