"""The colour of a tensor x checkpoint cell, shared by ``--plot`` and ``--heatmap``.

A cell's colour is its value on a log scale relative to its row's median (so a spike
stands out whatever the row's scale): blue below, pale at the median, red above, full
colour at ``span`` decades away. NaN/Inf are black and cells without a value white:
no finite value gets either (every colour of the scale has a channel of at least 33
and none is pure white).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np

from ...text import shown_key

LOW = (33, 102, 172)     # far below the row's median
MIDDLE = (247, 247, 247)  # at the median
HIGH = (178, 24, 43)     # far above
NONFINITE = (0, 0, 0)
MISSING = (255, 255, 255)
MIN_SPAN, MAX_SPAN = 1.0, 4.0  # decades at full colour


@dataclass
class Shades:
    """Per cell: ``level`` in [-1, 1] (NaN: no finite level), and which cells are NaN/Inf or missing."""

    level: np.ndarray
    nonfinite: np.ndarray
    missing: np.ndarray
    span: float                   # decades from the median to full colour
    medians: np.ndarray           # per row (NaN: none)


def shades(values: np.ndarray, present: np.ndarray) -> Shades:
    """Levels of a (rows x columns) grid: log10(value / row median) / span, clipped to [-1, 1]."""
    values = np.asarray(values, dtype=np.float64)
    finite = present & np.isfinite(values)
    nonfinite = present & ~np.isfinite(values)
    positive = finite & (values > 0)
    medians = np.full(values.shape[0], np.nan)
    for r in range(values.shape[0]):
        row = values[r][positive[r]]
        if row.size:
            medians[r] = float(np.median(row))
    with np.errstate(divide="ignore", invalid="ignore"):
        ratio = np.log10(values) - np.log10(medians)[:, None]
    ratio = np.where(finite & (values <= 0), -np.inf, ratio)
    ratio = np.where(finite, ratio, np.nan)
    usable = np.isfinite(ratio)
    largest = float(np.max(np.abs(ratio[usable]))) if usable.any() else 0.0
    span = min(MAX_SPAN, max(MIN_SPAN, largest))
    with np.errstate(invalid="ignore"):
        level = np.clip(ratio / span, -1.0, 1.0)
    level = np.where(finite & np.isnan(level), 0.0, level)  # a row without a median: its cells at the middle
    return Shades(level, nonfinite, ~present, span, medians)


def rgb(s: Shades) -> np.ndarray:
    """The cells' colours, (rows x columns x 3) uint8."""
    level = np.nan_to_num(s.level, nan=0.0)[..., None]
    low, middle, high = (np.array(c, dtype=np.float64) for c in (LOW, MIDDLE, HIGH))
    up = middle + (high - middle) * np.clip(level, 0, 1)
    down = middle + (low - middle) * np.clip(-level, 0, 1)
    out = np.where(level >= 0, up, down)
    out = np.rint(out).astype(np.uint8)
    out[s.nonfinite] = NONFINITE
    out[s.missing] = MISSING
    return out


def colour_at(level: float) -> tuple[int, int, int]:
    """The colour of one level in [-1, 1] (for legends)."""
    end = HIGH if level >= 0 else LOW
    t = min(1.0, abs(level))
    red, green, blue = (int(round(m + (e - m) * t)) for m, e in zip(MIDDLE, end))
    return red, green, blue


_LAYER = re.compile(r"(?:^|\.)(?:layers|layer|blocks|block|blk|h|encoder\.layer|decoder\.layers)\.(\d+)(?:\.|$)")


def layer_of(name: str) -> int | None:
    """The layer number in a tensor's name (``model.layers.17.mlp...``: 17), or None."""
    match = _LAYER.search(name)
    return int(match[1]) if match else None


def row_order(names: list[str]) -> list[int]:
    """Rows in natural order, so each layer's tensors come together (layers.2 before layers.10)."""
    return sorted(range(len(names)), key=lambda i: shown_key(names[i]))


def ratio_text(level: float, span: float) -> str:
    """The factor from the median a level stands for (legend ticks)."""
    factor = 10 ** (level * span)
    if factor >= 1:
        return f"x{factor:.3g}"
    return f"x{factor:.2g}"
