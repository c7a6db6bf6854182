"""The loss history from MaxText's log lines, and the PNG that draws it (decoded here, byte by byte)."""

from __future__ import annotations

import struct
import zlib

import pytest

from maxtext_sft.loss_curve import (
    AXIS,
    CURVE,
    INSET,
    Scale,
    downsample,
    final_loss_text,
    parse_loss_history,
    plot_box,
    render_loss_curve,
)
from maxtext_sft.png import PNG_SIGNATURE, Canvas, encode_png


def step_line(step: int, loss: str) -> str:
    """A line as MaxText 0.2.2 (and the fast stand-in) logs it."""
    return (
        f"I1130 08:12:44.123456  4242 metric_logger.py:196] completed step: {step}, seconds: 0.012, "
        f"TFLOP/s/device: 1.234, Tokens/s/device: 21333.333, total_weights: 204, loss: {loss}, "
        "lm_loss: 0.000, perplexity: 0.000"
    )


def decode_png(data: bytes) -> tuple[int, int, list[list[tuple[int, int, int]]]]:
    """Width, height and rows of RGB pixels: an independent reader of what png.py writes."""
    assert data[:8] == PNG_SIGNATURE
    position, chunks = 8, []
    while position < len(data):
        (length,) = struct.unpack(">I", data[position : position + 4])
        kind, body = data[position + 4 : position + 8], data[position + 8 : position + 8 + length]
        (crc,) = struct.unpack(">I", data[position + 8 + length : position + 12 + length])
        assert crc == zlib.crc32(kind + body), kind
        chunks.append((kind, body))
        position += 12 + length
    assert [kind for kind, _ in chunks] == [b"IHDR", b"IDAT", b"IEND"]
    width, height, depth, colour, compression, filtering, interlace = struct.unpack(">IIBBBBB", chunks[0][1])
    assert (depth, colour, compression, filtering, interlace) == (8, 2, 0, 0, 0)
    raw = zlib.decompress(chunks[1][1])
    stride = 1 + width * 3
    assert len(raw) == stride * height
    rows = []
    for y in range(height):
        line = raw[y * stride : (y + 1) * stride]
        assert line[0] == 0  # filter type none
        rows.append([tuple(line[1 + 3 * x : 4 + 3 * x]) for x in range(width)])
    return width, height, rows


def near(rows, x: int, y: int, color, radius: int = 1) -> bool:
    return any(
        rows[y + dy][x + dx] == color for dx in range(-radius, radius + 1) for dy in range(-radius, radius + 1)
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


def test_the_encoder_writes_a_png_any_reader_takes():
    pixels = bytes([255, 0, 0, 0, 255, 0, 0, 0, 255, 10, 20, 30])
    width, height, rows = decode_png(encode_png(2, 2, pixels))
    assert (width, height) == (2, 2)
    assert rows == [[(255, 0, 0), (0, 255, 0)], [(0, 0, 255), (10, 20, 30)]]
    with pytest.raises(ValueError):
        encode_png(3, 2, pixels)


def test_canvas_lines_reach_both_ends_and_ignore_what_falls_outside():
    canvas = Canvas(10, 10)
    canvas.line(0, 9, 9, 0, (1, 2, 3))
    canvas.line(-5, 5, 20, 5, (4, 5, 6))  # clipped, not an error
    assert canvas.get(0, 9) == canvas.get(9, 0) == (1, 2, 3)
    assert all(canvas.get(x, 5) == (4, 5, 6) for x in range(10))


def test_the_chart_has_its_size_axes_and_the_curve_where_the_points_are():
    history = [[10, 3.0], [20, 2.0], [30, 1.5], [40, 1.0]]
    width, height, rows = decode_png(render_loss_curve(history, width=400, height=300))
    assert (width, height) == (400, 300)
    left, top, right, bottom = plot_box(400, 300)
    assert all(rows[y][left] == AXIS for y in range(top, bottom + 1))  # the loss axis
    assert all(rows[bottom][x] == AXIS for x in range(left, right + 1))  # the step axis
    # The first point is the highest loss at the first step: top left of the plot; the last, bottom right.
    assert near(rows, left + INSET, top + INSET, CURVE)
    assert near(rows, right - INSET, bottom - INSET, CURVE)
    scale = Scale(history, 400, 300)
    for (s0, l0), (s1, l1) in zip(history, history[1:]):
        x, y = (scale.x(s0) + scale.x(s1)) // 2, (scale.y(l0) + scale.y(l1)) // 2
        assert near(rows, x, y, CURVE, radius=2), (s0, s1)
    # Nothing of the curve outside the plot box.
    for y, row in enumerate(rows):
        for x, pixel in enumerate(row):
            if pixel == CURVE:
                assert left < x < right and top < y < bottom, (x, y)
    # Tick labels were drawn below the step axis and left of the loss axis.
    assert any(AXIS in rows[y][left:right] for y in range(bottom + 8, bottom + 18))
    assert any(AXIS in rows[y][:left - 6] for y in range(top, bottom))


def test_a_gap_where_the_loss_was_not_a_number_and_a_lone_point_still_shows():
    history = [[1, 2.0], [2, None], [3, 1.0]]
    _, _, rows = decode_png(render_loss_curve(history))
    scale = Scale(history)
    middle_x, middle_y = scale.x(2), (scale.y(2.0) + scale.y(1.0)) // 2
    assert not near(rows, middle_x, middle_y, CURVE, radius=3)  # not joined across the NaN
    assert near(rows, scale.x(1), scale.y(2.0), CURVE) and near(rows, scale.x(3), scale.y(1.0), CURVE)
    _, _, rows = decode_png(render_loss_curve([[7, 0.5]]))
    scale = Scale([[7, 0.5]])
    assert near(rows, scale.x(7), scale.y(0.5), CURVE)
    decode_png(render_loss_curve([]))  # an empty history is an empty chart, not an error


def test_the_final_loss_is_the_final_steps_as_printed():
    lines = ["completed step: 11, seconds: 0.1, loss: 2.0", "noise", "completed step: 12, seconds: 0.1, loss: nan"]
    assert final_loss_text(lines, 12) == "nan"  # as text: the publishing gate refuses a NaN, not a missing loss
    assert final_loss_text(lines, 13) is None
