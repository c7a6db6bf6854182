"""The training's loss per step: read from MaxText's log lines, kept in the run record, drawn as a PNG.

Pure functions (no Airflow), so tests need neither a VM nor a scheduler.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Sequence

from maxtext_sft.png import Canvas

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


# The chart: a plot box inside margins that hold the tick labels.
WIDTH, HEIGHT = 640, 400
MARGIN_LEFT, MARGIN_RIGHT, MARGIN_TOP, MARGIN_BOTTOM = 80, 24, 28, 44
INSET = 6  # the curve keeps this far from the axes, so it never hides behind them
BACKGROUND, AXIS, GRID, CURVE = (255, 255, 255), (0, 0, 0), (225, 225, 225), (31, 119, 180)
TICKS = 5


def plot_box(width: int = WIDTH, height: int = HEIGHT) -> tuple[int, int, int, int]:
    """(left, top, right, bottom) of the plot area, in pixels; the axes are its left and bottom edges."""
    return MARGIN_LEFT, MARGIN_TOP, width - MARGIN_RIGHT, height - MARGIN_BOTTOM


class Scale:
    """Step -> x pixel and loss -> y pixel (higher loss is higher up), inside the plot box."""

    def __init__(self, history: Sequence[Sequence], width: int = WIDTH, height: int = HEIGHT):
        steps = [step for step, _ in history]
        losses = [loss for _, loss in history if loss is not None]
        self.left, self.top, self.right, self.bottom = plot_box(width, height)
        self.steps = (min(steps), max(steps)) if steps else (0, 1)
        self.losses = (min(losses), max(losses)) if losses else (0.0, 1.0)

    @staticmethod
    def _place(value: float, low: float, high: float, start: int, end: int) -> int:
        if high == low:  # one step, or a flat loss: the middle
            return round((start + end) / 2)
        return round(start + (value - low) / (high - low) * (end - start))

    def x(self, step: float) -> int:
        return self._place(step, *self.steps, self.left + INSET, self.right - INSET)

    def y(self, loss: float) -> int:
        return self._place(loss, *self.losses, self.bottom - INSET, self.top + INSET)


def _label(value: float) -> str:
    return f"{value:.4g}".replace("e+0", "e").replace("e-0", "e-")


def render_loss_curve(history: Sequence[Sequence], width: int = WIDTH, height: int = HEIGHT) -> bytes:
    """A PNG of loss against step: axes, grid, tick labels and the curve (broken where the loss
    was not a number; a lone point drawn as a dot)."""
    canvas = Canvas(width, height, BACKGROUND)
    scale = Scale(history, width, height)
    left, top, right, bottom = plot_box(width, height)
    for i in range(TICKS):
        fraction = i / (TICKS - 1)
        step = scale.steps[0] + fraction * (scale.steps[1] - scale.steps[0])
        loss = scale.losses[0] + fraction * (scale.losses[1] - scale.losses[0])
        x, y = scale.x(step), scale.y(loss)
        canvas.line(x, top, x, bottom, GRID)
        canvas.line(left, y, right, y, GRID)
        canvas.line(x, bottom, x, bottom + 4, AXIS)
        canvas.line(left - 4, y, left, y, AXIS)
        text = _label(round(step) if scale.steps[1] - scale.steps[0] >= TICKS else step)
        canvas.text(x - Canvas.text_width(text) // 2, bottom + 8, text, AXIS)
        text = _label(loss)
        canvas.text(left - 8 - Canvas.text_width(text), y - 5, text, AXIS)
    canvas.line(left, top, left, bottom, AXIS)
    canvas.line(left, bottom, right, bottom, AXIS)
    canvas.text(right - Canvas.text_width("STEP"), height - 14, "STEP", AXIS)
    canvas.text(left - 8 - Canvas.text_width("LOSS"), top - 20, "LOSS", AXIS)
    previous = None
    for step, loss in history:
        if loss is None:
            previous = None
            continue
        point = (scale.x(step), scale.y(loss))
        if previous is None:
            canvas.line(*point, *point, CURVE, thickness=3)
        else:
            canvas.line(*previous, *point, CURVE, thickness=2)
        previous = point
    return canvas.png()
