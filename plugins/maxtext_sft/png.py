"""A small PNG writer: an RGB canvas with lines and a 3x5 pixel font, encoded with zlib and struct.

The lock has no imaging or plotting library, and a chart of one line needs none: this draws
pixels into a bytearray and writes the three chunks a PNG needs (IHDR, IDAT, IEND), 8-bit RGB,
no interlacing, every row with filter type 0.
"""

from __future__ import annotations

import struct
import zlib

Color = tuple[int, int, int]

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"

# 3x5 glyphs: what axis labels need (numbers as Python formats them, and two words).
GLYPHS: dict[str, tuple[str, ...]] = {
    "0": ("###", "#.#", "#.#", "#.#", "###"),
    "1": (".#.", "##.", ".#.", ".#.", "###"),
    "2": ("###", "..#", "###", "#..", "###"),
    "3": ("###", "..#", "###", "..#", "###"),
    "4": ("#.#", "#.#", "###", "..#", "..#"),
    "5": ("###", "#..", "###", "..#", "###"),
    "6": ("###", "#..", "###", "#.#", "###"),
    "7": ("###", "..#", "..#", "..#", "..#"),
    "8": ("###", "#.#", "###", "#.#", "###"),
    "9": ("###", "#.#", "###", "..#", "###"),
    ".": ("...", "...", "...", "...", ".#."),
    "-": ("...", "...", "###", "...", "..."),
    "+": ("...", ".#.", "###", ".#.", "..."),
    " ": ("...", "...", "...", "...", "..."),
    "E": ("###", "#..", "##.", "#..", "###"),
    "L": ("#..", "#..", "#..", "#..", "###"),
    "O": (".#.", "#.#", "#.#", "#.#", ".#."),
    "P": ("##.", "#.#", "##.", "#..", "#.."),
    "S": (".##", "#..", ".#.", "..#", "##."),
    "T": ("###", ".#.", ".#.", ".#.", ".#."),
}


class Canvas:
    """Pixels, row by row, 3 bytes each; drawing outside the canvas is ignored."""

    def __init__(self, width: int, height: int, background: Color = (255, 255, 255)):
        self.width, self.height = width, height
        self.pixels = bytearray(bytes(background) * (width * height))

    def set(self, x: int, y: int, color: Color) -> None:
        if 0 <= x < self.width and 0 <= y < self.height:
            i = (y * self.width + x) * 3
            self.pixels[i : i + 3] = bytes(color)

    def get(self, x: int, y: int) -> Color:
        i = (y * self.width + x) * 3
        return tuple(self.pixels[i : i + 3])  # type: ignore[return-value]

    def line(self, x0: int, y0: int, x1: int, y1: int, color: Color, thickness: int = 1) -> None:
        """Bresenham's line, each point drawn as a thickness x thickness square."""
        dx, dy = abs(x1 - x0), -abs(y1 - y0)
        sx, sy = (1 if x0 < x1 else -1), (1 if y0 < y1 else -1)
        error = dx + dy
        while True:
            for ox in range(thickness):
                for oy in range(thickness):
                    self.set(x0 + ox, y0 + oy, color)
            if x0 == x1 and y0 == y1:
                return
            twice = 2 * error
            if twice >= dy:
                error += dy
                x0 += sx
            if twice <= dx:
                error += dx
                y0 += sy

    def text(self, x: int, y: int, text: str, color: Color, scale: int = 2) -> None:
        """Draw `text` with its top-left corner at (x, y); characters without a glyph are skipped."""
        for char in text.upper():
            for row, bits in enumerate(GLYPHS.get(char, GLYPHS[" "])):
                for column, bit in enumerate(bits):
                    if bit == "#":
                        for ox in range(scale):
                            for oy in range(scale):
                                self.set(x + column * scale + ox, y + row * scale + oy, color)
            x += 4 * scale  # 3 pixels of glyph, 1 of space

    @staticmethod
    def text_width(text: str, scale: int = 2) -> int:
        return max(0, 4 * scale * len(text) - scale)

    def png(self) -> bytes:
        return encode_png(self.width, self.height, bytes(self.pixels))


def encode_png(width: int, height: int, rgb: bytes) -> bytes:
    """A PNG of `rgb` (width * height * 3 bytes, rows top to bottom)."""
    stride = width * 3
    if len(rgb) != stride * height:
        raise ValueError(f"{len(rgb)} bytes are not {width}x{height} RGB pixels")
    # Each scanline starts with its filter type; 0 (none) keeps the writer trivial, zlib does the rest.
    raw = b"".join(b"\x00" + rgb[row * stride : (row + 1) * stride] for row in range(height))

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)  # 8-bit, truecolour, no interlace
    return PNG_SIGNATURE + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(raw, 9)) + chunk(b"IEND", b"")
