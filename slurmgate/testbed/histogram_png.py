"""Draw a histogram as a small PNG with the standard library only (no matplotlib at run time).

The allocation flow publishes a load report's latency histogram as a Prefect image artifact;
the client host has the runtime's dependencies, not the dev extra, so the picture is drawn
here: equal-width bars on a white ground, with optional vertical markers (p50, p99).
"""

from __future__ import annotations

import base64
import struct
import zlib
from collections.abc import Sequence

Color = tuple[int, int, int]

BAR: Color = (66, 110, 200)
AXIS: Color = (120, 120, 120)
WHITE: Color = (255, 255, 255)
MAX_SIDE = 2000


def _chunk(kind: bytes, data: bytes) -> bytes:
    return (
        struct.pack(">I", len(data))
        + kind
        + data
        + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)
    )


def encode_png(pixels: Sequence[bytearray], width: int) -> bytes:
    """An 8-bit RGB PNG from rows of ``width * 3`` bytes, top row first."""
    raw = b"".join(b"\x00" + bytes(row) for row in pixels)
    header = struct.pack(">IIBBBBB", width, len(pixels), 8, 2, 0, 0, 0)
    return (
        b"\x89PNG\r\n\x1a\n"
        + _chunk(b"IHDR", header)
        + _chunk(b"IDAT", zlib.compress(raw, 9))
        + _chunk(b"IEND", b"")
    )


def histogram_png(
    counts: Sequence[float],
    *,
    edges: Sequence[float] | None = None,
    markers: Sequence[tuple[float, Color]] = (),
    width: int = 480,
    height: int = 180,
) -> bytes:
    """Bars for ``counts`` (tallest bar fills the height); each marker is a vertical line at
    its value on the ``edges`` scale (markers outside the edges are left out)."""
    if not (16 <= width <= MAX_SIDE and 16 <= height <= MAX_SIDE):
        raise ValueError(f"width and height must be in 16..{MAX_SIDE}")
    margin = 4
    plot_w, plot_h = width - 2 * margin, height - 2 * margin
    rows = [bytearray(WHITE * width) for _ in range(height)]

    def paint(x: int, y: int, color: Color) -> None:
        if 0 <= x < width and 0 <= y < height:
            rows[y][3 * x : 3 * x + 3] = bytes(color)

    tallest = max(counts, default=0.0)
    n = len(counts)
    for i, count in enumerate(counts):
        if tallest <= 0 or count <= 0:
            continue
        left = margin + (i * plot_w) // n
        right = margin + ((i + 1) * plot_w) // n - 1  # one pixel gap between bars
        top = margin + plot_h - max(1, round(plot_h * count / tallest))
        for y in range(top, margin + plot_h):
            for x in range(left, max(left + 1, right)):
                paint(x, y, BAR)
    if edges is not None and len(edges) >= 2 and edges[-1] > edges[0]:
        low, span = edges[0], edges[-1] - edges[0]
        for value, color in markers:
            if low <= value <= edges[-1]:
                x = margin + min(plot_w - 1, int(plot_w * (value - low) / span))
                for y in range(margin, margin + plot_h):
                    paint(x, y, color)
    for x in range(margin, margin + plot_w):
        paint(x, margin + plot_h, AXIS)
    for y in range(margin, margin + plot_h + 1):
        paint(margin - 1, y, AXIS)
    return encode_png(rows, width)


def data_uri(png: bytes) -> str:
    """The PNG as a ``data:image/png;base64,...`` URL (what an image artifact can point at)."""
    return "data:image/png;base64," + base64.b64encode(png).decode("ascii")
