"""The plan: from every file's statistics and a clip mode, what pass 2 does to each tensor.

``global`` reduces the statistics of all files to one norm (an exact sum of every
tensor's sum of squares); the other modes work per tensor. The arithmetic is
:mod:`tclip.core.modes`'; this module only distributes it over files."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from ..core.modes import (
    GlobalNormClip,
    Mode,
    ValueClip,
    plan_scales,
    value_bounds,
)
from .statistics import FileStats


@dataclass
class TensorWork:
    """What pass 2 does to one tensor: multiply by ``scale`` (a 0-d array, or one
    factor per slice in keepdims form) or clamp to ``bounds``."""

    scale: np.ndarray | None = None
    bounds: tuple[float, float] | None = None


@dataclass
class Plan:
    """Pass 2's work for every file of a run: ``work[path][tensor]``; tensors not listed are copied."""

    mode: Mode
    work: dict[str, dict[str, TensorWork]]
    scales: dict[str, dict[str, np.ndarray]]
    global_norm: float | None = None


def make_plan(mode: Mode, files: list[FileStats]) -> Plan:
    """Scale factors (or value bounds) for every selected tensor of every file.

    ``global`` reduces the statistics of all files to one norm (an exact sum of
    every tensor's sum of squares); the other modes work per tensor.
    """
    work: dict[str, dict[str, TensorWork]] = {}
    scales: dict[str, dict[str, np.ndarray]] = {}
    global_norm = None
    if isinstance(mode, GlobalNormClip):
        # each stored element once: tensors sharing a storage (tied weights) are one parameter
        every = [f.counted_sum_of_squares(n) for f in files for n in f.selected]
        global_norm = (math.sqrt(math.fsum(every)) if every else 0.0) if mode.use_norm is None \
            else float(mode.use_norm)
    for stats in files:
        chosen = {n: stats.stats[n] for n in stats.selected}
        file_work: dict[str, TensorWork] = {}
        if isinstance(mode, ValueClip):
            dtypes = {t.name: t.dtype for t in stats.tensors}
            for name, s in chosen.items():
                lo, hi = _value_bounds_of(dtypes[name], mode)
                if s.min_value < lo or s.max_value > hi:
                    file_work[name] = TensorWork(bounds=(lo, hi))
            scales[stats.path] = {}
        else:
            if isinstance(mode, GlobalNormClip):
                file_scales = plan_scales(GlobalNormClip(mode.clip_norm, global_norm), chosen)
            else:
                file_scales = plan_scales(mode, chosen)
            scales[stats.path] = file_scales
            for name, scale in file_scales.items():
                if not np.all(scale == 1.0):
                    file_work[name] = TensorWork(scale=scale)
        work[stats.path] = file_work
    return Plan(mode, work, scales, global_norm)


def _value_bounds_of(dtype: np.dtype, mode: ValueClip) -> tuple[float, float]:
    lo, hi = value_bounds(dtype, mode.clip_value_min, mode.clip_value_max)
    return float(lo), float(hi)
