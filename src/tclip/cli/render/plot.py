"""``report --summary --plot FILE``: the tensors x checkpoints grid as one self-contained picture.

The format follows the suffix: ``.svg`` (no external reference: the cells are one PNG
embedded as a data URI, drawn pixelated, so 200 tensors x 1000 steps stay tens of KB),
``.html`` (the same SVG, the values as JSON and a few lines of script showing the
tensor, checkpoint and value under the pointer; no CDN, no ``<script src>``), ``.png``
(drawn with Pillow, an optional extra: ``pip install 'tclip[png]'``).

Rows are the tensors in natural order (each layer's tensors together; a line between
layers), columns the checkpoints in step order; colours as :mod:`.cells` gives them.
The stdlib writes the PNG (zlib + struct), so nothing here costs start-up time.
"""

from __future__ import annotations

import base64
import json
import math
import os
import struct
import tempfile
import zlib
from pathlib import Path
from typing import Any
from xml.sax.saxutils import escape

import numpy as np

from ...work.history import Grid
from .cells import (
    MISSING,
    NONFINITE,
    Shades,
    colour_at,
    layer_of,
    ratio_text,
    rgb,
    row_order,
    shades,
)
from .table import shorten_names

_WHAT = {"grads": "gradient norm over each interval (Adam exp_avg_sq)",
         "drift": "relative change ||W_t - W_t-1|| / ||W_t-1||",
         "norms": "tensor norm"}
FONT = 11
CHAR = 6.7           # monospace advance at FONT px (about 0.6 em)
NAME_WIDTH = 48      # characters of a row label at most (shortened as the tables shorten names)


class PlotError(Exception):
    """The picture could not be made (Pillow missing for .png)."""


class Layout:
    """Where everything goes, in SVG user units (pixels)."""

    def __init__(self, rows: int, columns: int, row_names: list[str], column_names: list[str],
                 title: str = "") -> None:
        self.rows, self.columns = rows, columns
        self.cell_w = max(1, min(24, 1200 // max(1, columns)))
        self.cell_h = 12 if rows <= 300 else max(1, min(12, 3000 // max(1, rows)))
        self.row_every = max(1, math.ceil(10 / self.cell_h))   # a label every k rows, never overlapping
        self.column_every = max(1, math.ceil(12 / self.cell_w))
        label = max([len(n) for n in row_names] + [8])
        self.left = int(label * CHAR) + 16
        self.top = 64
        self.grid_w, self.grid_h = columns * self.cell_w, rows * self.cell_h
        longest = max([len(n) for n in column_names] + [4])
        self.bottom_labels = int(min(longest, 24) * CHAR) + 10
        self.right = 70  # layer numbers
        self.width = max(self.left + self.grid_w + self.right, 640, int(min(len(title), 160) * 8) + 16)
        self.legend_y = self.top + self.grid_h + self.bottom_labels + 16
        self.height = self.legend_y + 56


def picture_data(grid: Grid, labels: list[str]) -> tuple[list[int], Shades, np.ndarray, list[str], list[str]]:
    order = row_order(grid.rows)
    values = grid.array()[order] if order else np.zeros((0, len(grid.columns)))
    present = grid.present()[order] if order else np.zeros((0, len(grid.columns)), dtype=bool)
    s = shades(values, present)
    names = [grid.rows[i] for i in order]
    short = shorten_names(names, NAME_WIDTH, "…")  # as the tables shorten them
    return order, s, values, [short[n] for n in names], [_cut(x, 24) for x in labels]


def write_plot(grid: Grid, labels: list[str], path: Path, command: str) -> None:
    """Write the picture, its format by ``path``'s suffix (.svg, .html, .png); nothing on failure."""
    suffix = path.suffix.lower()
    if suffix == ".png":
        data = png_picture(grid, labels, command)
    elif suffix == ".html":
        data = html_picture(grid, labels, command).encode()
    elif suffix == ".svg":
        data = svg_picture(grid, labels, command).encode()
    else:
        raise PlotError(f"the picture's format is chosen by its suffix: .svg, .html or .png, not {suffix!r}")
    folder = path.parent if str(path.parent) else Path(".")
    fd, temporary = tempfile.mkstemp(prefix=f".{path.name}.", dir=folder)
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
        mask = os.umask(0)
        os.umask(mask)
        os.chmod(temporary, 0o666 & ~mask)  # as open() would create it (mkstemp makes it private)
        os.replace(temporary, path)
    except BaseException:
        try:
            os.unlink(temporary)
        except OSError:
            pass
        raise


# --------------------------------------------------------------------------- SVG


def svg_picture(grid: Grid, labels: list[str], command: str, *, cells_id: str = "cells") -> str:
    order, s, _, names, columns = picture_data(grid, labels)
    box = Layout(len(order), len(grid.columns), names, columns, command)
    image = png_bytes(rgb(s)) if order and grid.columns else png_bytes(np.full((1, 1, 3), 255, np.uint8))
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{box.width}" height="{box.height}" '
           f'viewBox="0 0 {box.width} {box.height}" font-family="DejaVu Sans Mono, Menlo, Consolas, monospace" '
           f'font-size="{FONT}">',
           f"<title>{escape(command)}</title>",
           f'<rect width="{box.width}" height="{box.height}" fill="#ffffff"/>',
           f'<text x="8" y="18" font-size="13" font-weight="bold">{escape(_cut(command, 160))}</text>',
           f'<text x="8" y="36">{escape(_WHAT[grid.quantity])}, {len(order)} tensors x {len(grid.columns)} '
           "checkpoints</text>",
           '<text x="8" y="50">colour: value / its row\'s median, log scale</text>']
    x0, y0 = box.left, box.top
    out.append(f'<image id="{cells_id}" x="{x0}" y="{y0}" width="{box.grid_w}" height="{box.grid_h}" '
               f'preserveAspectRatio="none" style="image-rendering:pixelated;image-rendering:crisp-edges" '
               f'href="data:image/png;base64,{base64.b64encode(image).decode()}"/>')
    out.append(f'<rect x="{x0 - 0.5}" y="{y0 - 0.5}" width="{box.grid_w + 1}" height="{box.grid_h + 1}" '
               f'fill="none" stroke="#888" stroke-width="1"/>')
    out.append('<g text-anchor="end">')
    for r, name in enumerate(names):
        if r % box.row_every == 0:
            y = y0 + (r + 0.5) * box.cell_h + FONT * 0.35
            out.append(f'<text x="{x0 - 6}" y="{y:.1f}">{escape(name)}</text>')
    out.append("</g>")
    layers = [layer_of(grid.rows[i]) for i in order]
    out.append('<g stroke="#444" stroke-width="1">')
    starts = [r for r in range(len(layers)) if r == 0 or layers[r] != layers[r - 1]]
    for r in starts[1:]:
        y = y0 + r * box.cell_h
        out.append(f'<line x1="{x0}" y1="{y}" x2="{x0 + box.grid_w}" y2="{y}"/>')
    out.append("</g>")
    out.append('<g fill="#444">')
    for i, r in enumerate(starts):
        if layers[r] is None:
            continue
        end = starts[i + 1] if i + 1 < len(starts) else len(layers)
        y = y0 + (r + end) / 2 * box.cell_h + FONT * 0.35
        out.append(f'<text x="{x0 + box.grid_w + 6}" y="{y:.1f}">layer {layers[r]}</text>')
    out.append("</g>")
    out.append('<g text-anchor="end">')
    for c, label in enumerate(columns):
        if c % box.column_every == 0 or c == len(columns) - 1 and box.column_every == 1:
            x = x0 + (c + 0.5) * box.cell_w + FONT * 0.35
            y = y0 + box.grid_h + 6
            out.append(f'<text transform="translate({x:.1f},{y}) rotate(-90)">{escape(label)}</text>')
    out.append("</g>")
    out += _legend(s, box)
    out.append("</svg>")
    return "\n".join(out) + "\n"


def _legend(s: Shades, box: Layout) -> list[str]:
    x, y, steps, width = 8, box.legend_y, 90, 360
    out = [f'<text x="{x}" y="{y - 4}">value / row median:</text>', '<g id="legend">']
    for i in range(steps):
        level = -1 + 2 * (i + 0.5) / steps
        out.append(f'<rect x="{x + i * width / steps:.2f}" y="{y}" width="{width / steps + 0.3:.2f}" height="12" '
                   f'fill="{_hex(colour_at(level))}"/>')
    out.append("</g>")
    for level in (-1.0, -0.5, 0.0, 0.5, 1.0):
        tx = x + (level + 1) / 2 * width
        text = ("<=" if level == -1 else ">=" if level == 1 else "") + ratio_text(level, s.span)
        anchor = "start" if level == -1 else "end" if level == 1 else "middle"
        out.append(f'<text x="{tx:.1f}" y="{y + 26}" text-anchor="{anchor}">{escape(text)}</text>')
    sx = x + width + 40
    out.append(f'<rect x="{sx}" y="{y}" width="12" height="12" fill="{_hex(NONFINITE)}"/>')
    out.append(f'<text x="{sx + 16}" y="{y + 10}">NaN/Inf</text>')
    out.append(f'<rect x="{sx + 90}" y="{y}" width="12" height="12" fill="{_hex(MISSING)}" stroke="#888"/>')
    out.append(f'<text x="{sx + 106}" y="{y + 10}">no value</text>')
    return out


def _hex(colour: tuple[int, int, int] | Any) -> str:
    return "#%02x%02x%02x" % tuple(int(c) for c in colour)


def _cut(text: str, width: int) -> str:
    return text if len(text) <= width else text[: width - 1] + "~"


def png_bytes(pixels: np.ndarray) -> bytes:
    """An RGB PNG of ``pixels`` (rows x columns x 3, uint8): zlib and struct only."""
    height, width = pixels.shape[:2]
    raw = np.zeros((height, width * 3 + 1), dtype=np.uint8)  # filter byte 0 (None) per row
    raw[:, 1:] = pixels.reshape(height, width * 3)

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(raw.tobytes(), 9))
            + chunk(b"IEND", b""))


# --------------------------------------------------------------------------- HTML


_SCRIPT = """
(function () {
  var d = JSON.parse(document.getElementById("grid-data").textContent);
  var img = document.getElementById("cells"), tip = document.getElementById("tip");
  function show(e) {
    var b = img.getBoundingClientRect();
    var c = Math.floor((e.clientX - b.left) / b.width * d.columns.length);
    var r = Math.floor((e.clientY - b.top) / b.height * d.rows.length);
    if (r < 0 || c < 0 || r >= d.rows.length || c >= d.columns.length) { tip.style.display = "none"; return; }
    var v = d.values[r][c];
    tip.textContent = d.rows[r] + "\\n" + d.columns[c] + (d.steps[c] === null ? "" : " (step " + d.steps[c] + ")")
      + "\\n" + d.quantity + ": " + (v === null ? "no value" : v);
    tip.style.display = "block";
    tip.style.left = (e.pageX + 14) + "px"; tip.style.top = (e.pageY + 14) + "px";
  }
  img.addEventListener("mousemove", show);
  img.addEventListener("mouseleave", function () { tip.style.display = "none"; });
})();
"""


def html_picture(grid: Grid, labels: list[str], command: str) -> str:
    order = row_order(grid.rows)
    values = grid.values
    data = {
        "quantity": grid.quantity,
        "rows": [grid.rows[i] for i in order],
        "columns": labels,
        "steps": [None if s is None else (int(s) if s == int(s) else s) for s in grid.steps] or
                 [None] * len(grid.columns),
        "values": [[_json_number(values[i][c]) for c in range(len(grid.columns))] for i in order],
    }
    text = json.dumps(data, separators=(",", ":")).replace("</", "<\\/")
    return ("<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
            f"<title>{escape(command)}</title>"
            "<style>body{margin:12px;font-family:monospace;background:#fff}svg{display:block}"
            "#tip{position:absolute;display:none;white-space:pre;background:#ffffe8;border:1px solid #888;"
            "padding:4px 6px;font-size:12px;pointer-events:none}</style></head><body>\n"
            + svg_picture(grid, labels, command)
            + '<div id="tip"></div>\n'
            + f'<script type="application/json" id="grid-data">{text}</script>\n'
            + f"<script>{_SCRIPT}</script>\n</body></html>\n")


def _json_number(value: float | None) -> float | str | None:
    if value is None:
        return None
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return "Inf" if value > 0 else "-Inf"
    return float(f"{value:.6g}")


# --------------------------------------------------------------------------- PNG


def png_picture(grid: Grid, labels: list[str], command: str) -> bytes:
    try:
        from PIL import Image, ImageDraw, ImageFont
    except ImportError:
        raise PlotError("writing .png needs Pillow (pip install 'tclip[png]'); .svg and .html need nothing") \
            from None
    import io

    order, s, _, names, columns = picture_data(grid, labels)
    box = Layout(len(order), len(grid.columns), names, columns, command)
    canvas = Image.new("RGB", (box.width, box.height), (255, 255, 255))
    draw = ImageDraw.Draw(canvas)
    font = ImageFont.load_default()
    draw.text((8, 6), _cut(command, 160), fill=(0, 0, 0), font=font)
    draw.text((8, 24), f"{_WHAT[grid.quantity]}, {len(order)} tensors x {len(grid.columns)} checkpoints",
              fill=(0, 0, 0), font=font)
    draw.text((8, 40), "colour: value / its row's median, log scale", fill=(0, 0, 0), font=font)
    if order and grid.columns:
        cells = Image.fromarray(rgb(s), "RGB").resize((box.grid_w, box.grid_h), Image.Resampling.NEAREST)
        canvas.paste(cells, (box.left, box.top))
    draw.rectangle((box.left - 1, box.top - 1, box.left + box.grid_w, box.top + box.grid_h), outline=(136,) * 3)
    for r, name in enumerate(names):
        if r % box.row_every == 0:
            width = draw.textlength(name, font=font)
            draw.text((box.left - 6 - width, box.top + r * box.cell_h), name, fill=(0, 0, 0), font=font)
    layers = [layer_of(grid.rows[i]) for i in order]
    for r in range(1, len(layers)):
        if layers[r] != layers[r - 1]:
            y = box.top + r * box.cell_h
            draw.line((box.left, y, box.left + box.grid_w, y), fill=(68, 68, 68))
    for c, label in enumerate(columns):
        if c % box.column_every == 0:
            text = Image.new("RGB", (int(draw.textlength(label, font=font)) + 2, FONT + 3), (255, 255, 255))
            ImageDraw.Draw(text).text((0, 0), label, fill=(0, 0, 0), font=font)
            rotated = text.rotate(90, expand=True)
            canvas.paste(rotated, (box.left + c * box.cell_w + max(0, (box.cell_w - rotated.width) // 2),
                                   box.top + box.grid_h + 6))
    x, y = 8, box.legend_y
    draw.text((x, y - 14), "value / row median:", fill=(0, 0, 0), font=font)
    for i in range(360):
        draw.line((x + i, y, x + i, y + 11), fill=colour_at(-1 + 2 * (i + 0.5) / 360))
    for level in (-1.0, -0.5, 0.0, 0.5, 1.0):
        tick = ratio_text(level, s.span)
        shift = {-1.0: 0.0, 1.0: 1.0}.get(level, 0.5) * draw.textlength(tick, font=font)
        draw.text((x + (level + 1) / 2 * 360 - shift, y + 16), tick, fill=(0, 0, 0), font=font)
    sx = x + 400
    draw.rectangle((sx, y, sx + 11, y + 11), fill=NONFINITE)
    draw.text((sx + 16, y), "NaN/Inf", fill=(0, 0, 0), font=font)
    draw.rectangle((sx + 90, y, sx + 101, y + 11), fill=MISSING, outline=(136,) * 3)
    draw.text((sx + 106, y), "no value", fill=(0, 0, 0), font=font)
    buffer = io.BytesIO()
    canvas.save(buffer, "PNG", optimize=True)
    return buffer.getvalue()
