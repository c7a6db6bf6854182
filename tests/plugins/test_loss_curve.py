"""The loss history from MaxText's log lines, and the chart matplotlib draws of it (read back with
Pillow, matplotlib's own image library)."""

from __future__ import annotations

import io

from PIL import Image

from maxtext_sft.results.loss_curve import downsample, final_loss_text, parse_loss_history, render_loss_curve

# matplotlib's default colour cycle: tab:blue and tab:orange, as the chart draws train and eval.
TRAIN_BLUE, EVAL_ORANGE = (31, 119, 180), (255, 127, 14)


def step_line(step: int, loss: str) -> str:
    """A line as MaxText 0.2.2 (and the fast stand-in) logs it."""
    return (
        f"I1130 08:12:44.123456  4242 metric_logger.py:196] completed step: {step}, seconds: 0.012, "
        f"TFLOP/s/device: 1.234, Tokens/s/device: 21333.333, total_weights: 204, loss: {loss}, "
        "lm_loss: 0.000, perplexity: 0.000"
    )


def png_size(data: bytes) -> tuple[int, int]:
    image = Image.open(io.BytesIO(data))
    assert image.format == "PNG"
    return image.size


def count_colour(data: bytes, colour: tuple[int, int, int], tolerance: int = 12) -> int:
    """Pixels close to `colour` (antialiasing blends a line's edges)."""
    image = Image.open(io.BytesIO(data)).convert("RGB")
    return sum(
        1 for pixel in image.get_flattened_data() if all(abs(a - b) <= tolerance for a, b in zip(pixel, colour, strict=True))
    )


def test_the_history_is_by_step_with_the_last_loss_of_a_repeated_step_and_none_for_nan():
    lines = [
        "Train loop started",
        step_line(1, "2.500"),
        step_line(2, "2.000"),
        "completed profiler activation/deactivation step: 3, total_weights: 1, loss: 9.0",
        step_line(3, "1.750"),
        step_line(2, "1.900"),  # restarted from checkpoint 1: step 2 trained again
        step_line(4, "nan"),
        step_line(5, "inf"),
        "eval metrics after step: 5, loss=1.8, perplexity=6.0",
    ]
    assert parse_loss_history(lines) == [[1, 2.5], [2, 1.9], [3, 1.75], [4, None], [5, None]]


def test_a_long_history_is_thinned_keeping_the_first_and_last_points():
    history = [[step, 1.0 / step] for step in range(1, 10_001)]
    thin = downsample(history, limit=100)
    assert len(thin) == 100
    assert thin[0] == [1, 1.0] and thin[-1] == [10_000, 1.0 / 10_000]
    assert [s for s, _ in thin] == sorted({s for s, _ in thin})
    assert downsample(history[:50], limit=100) == history[:50]


def test_the_chart_is_a_png_with_the_training_curve_and_the_eval_points():
    history = [[step, 3.0 - step / 20] for step in range(1, 41)]
    train_only = render_loss_curve(history)
    assert png_size(train_only) == (640, 400)
    assert count_colour(train_only, TRAIN_BLUE) > 200  # a line across the plot
    assert count_colour(train_only, EVAL_ORANGE) == 0
    with_eval = render_loss_curve(history, eval_history=[[0, 3.2], [40, 1.2]])
    assert count_colour(with_eval, EVAL_ORANGE) > 50  # the eval line, its two markers and the legend's


def test_a_gap_where_the_loss_was_not_a_number_and_a_lone_point_still_shows():
    joined = count_colour(render_loss_curve([[1, 2.0], [2, 1.5], [3, 1.0]]), TRAIN_BLUE)
    broken = count_colour(render_loss_curve([[1, 2.0], [2, None], [3, 1.0]]), TRAIN_BLUE)
    assert broken < joined  # not joined across the NaN
    assert count_colour(render_loss_curve([[7, 0.5]]), TRAIN_BLUE) > 20  # a lone point is a marker
    assert png_size(render_loss_curve([])) == (640, 400)  # an empty history is an empty chart, not an error


def test_the_final_loss_is_the_final_steps_as_printed():
    lines = ["completed step: 11, seconds: 0.1, loss: 2.0", "noise", "completed step: 12, seconds: 0.1, loss: nan"]
    assert final_loss_text(lines, 12) == "nan"  # as text: the publishing gate refuses a NaN, not a missing loss
    assert final_loss_text(lines, 13) is None
