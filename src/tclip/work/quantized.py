"""Quantized weights in the passes: what is refused, what is warned about, what reports show.

A quantized weight is one logical tensor whose encoding reads its codes and scales
(:mod:`tclip.quant.encoding`): pass 1 measures its real values in closed
form, the plan gives it a factor like any tensor, and pass 2 applies the factor to
its scales only. What that cannot do exactly is refused here, before anything is
written, with one line naming the weight:

- a weight recognised as quantized but not understood (any clipping that selects it);
- per-slice clipping where a scale spans several slices (``norm --axes 1`` with
  128x128 blocks, a per-tensor or a global scale), or slices that are not rows;
- value clipping that would change any value (codes would have to be requantized);
- a factor E8M0 scales cannot take (not a power of two, or out of their range);
- different factors for NVFP4 weights sharing one global scale (a fused q/k/v or
  gate/up group: vLLM loads the largest of them, undoing a smaller one).

It also turns each weight's :class:`~tclip.quant.codes.Findings` into what people read:
zero scales (dead blocks) as warnings, and where NaN/Inf sit (codes or scales, which
block or row) for the ``--max-norm`` gate's line.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable
from typing import Any

import numpy as np

from ..core.modes import Mode, NormClip
from ..errors import UnsupportedError
from ..messages import Option
from ..quant.codes import Findings, is_power_of_two
from ..quant.layout import QuantLayout
from .plan import Plan, TensorWork
from .results import Note, NoteKind
from .selection import SkipKind, TensorEntry
from .statistics import FileStats

# Linear layers a consumer fuses into one matrix, which then has one global scale.
_FUSED = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"), ("q_a_proj", "kv_a_proj_with_mqa"),
          ("w1", "w3"))


def logical_names(names: Iterable[str], layout: QuantLayout | None) -> list[str]:
    """A set's tensor names as people see them: each quantized weight once, its parts not."""
    if not layout:
        return list(names)
    out = [n for n in names if n not in layout.part_of]
    return out + [w for w in layout.weights if w not in out]


def _describe(entry: TensorEntry) -> str:
    assert entry.encoding is not None
    scales = [p[0] for p in entry.encoding.parts[1:]]
    return f"{entry.name!r} ({entry.encoding.scheme}; scales {', '.join(repr(s) for s in scales)})"


def check_quantized_selection(entries: list[TensorEntry], mode: Mode, where: object) -> None:
    """Refuse, before any data is read, clipping what cannot be clipped by rewriting scales."""
    not_understood = [e for e in entries if e.skipped is not None and e.skipped.kind is SkipKind.NOT_UNDERSTOOD]
    if not_understood:
        first = not_understood[0]
        more = f" (and {len(not_understood) - 1} more)" if len(not_understood) > 1 else ""
        problem = first.encoding.problem if first.encoding is not None else "not understood"
        raise UnsupportedError((f"tensor {first.name!r}{more} is quantized and tclip cannot read it ({problem}); "
                                "nothing was written. Leave it out with ", Option.EXCLUDE, " to clip the rest"), where)
    fixed = [e for e in entries if e.skipped is None and e.encoding is not None and e.encoding.factors == "none"]
    if fixed:
        raise UnsupportedError((f"tensor {_describe(fixed[0])} is encoded in a way tclip cannot rescale; nothing was "
                                "written. Leave it out with ", Option.EXCLUDE, " to clip the rest"), where)
    axes = mode.axes if isinstance(mode, NormClip) else None
    if axes is None:
        return
    for entry in entries:
        if entry.skipped is not None or entry.encoding is None:
            continue
        ndim = len(entry.shape)
        wanted = sorted({a % ndim for a in ([axes] if isinstance(axes, int) else list(axes))})
        if wanted == list(range(ndim)):
            continue  # one slice: the whole tensor
        if wanted != [ndim - 1] or not entry.encoding.per_row:
            why = ("one scale serves several rows" if wanted == [ndim - 1] else
                   "only rows (the last axis) can have scales of their own")
            raise UnsupportedError((f"tensor {_describe(entry)} is quantized and its slices cannot be clipped one "
                                    f"by one by rewriting its scales ({why}); nothing was written. Clip it whole "
                                    "(without ", Option.AXES, ") or leave it out with ", Option.EXCLUDE), where)


def check_quantized_plan(plan: Plan, files: list[FileStats], where: object) -> None:
    """Refuse, after the plan and before anything is written, factors the scales cannot take."""
    fused: dict[tuple[str, float], list[tuple[str, float]]] = {}
    for stats in files:
        entries = {e.name: e for e in stats.tensors if e.encoding is not None and e.skipped is None}
        for name, task in plan.work.get(stats.path, {}).items():
            entry = entries.get(name)
            if entry is None:
                continue
            assert entry.encoding is not None
            if task.bounds is not None:
                raise UnsupportedError((f"tensor {_describe(entry)} is quantized: clamping its values would need "
                                        "its codes requantized, which tclip does not do; nothing was written. "
                                        "Leave it out with ", Option.EXCLUDE), where)
            factors = np.unique(np.asarray(task.scale, np.float64))
            found = stats.findings.get(name)
            if entry.encoding.factors == "power of two":
                _check_power_of_two(entry, factors, found, where)
            global_part = next((p for p in entry.encoding.parts if p[1] == "global scale"), None)
            if global_part is not None and found is not None and found.global_value is not None \
                    and factors.size == 1:
                key = _fused_key(name)
                if key is not None:
                    fused.setdefault((key, found.global_value), []).append((name, float(factors[0])))
    _check_fused(plan, files, fused, where)


def rescales_that_may_miss(plan: Plan, files: list[FileStats]) -> dict[str, dict[str, TensorWork]]:
    """Per file, the quantized weights with work whose rescale may miss its factor: some scale
    (by pass 1's smallest and largest) times the factor leaves its dtype's normal range. Their
    rewrite checks where they land (see ``BlockScaled``'s reducer); a set runs that check
    before any of its files is written, so that no file is committed before it fails."""
    import ml_dtypes

    risky: dict[str, dict[str, TensorWork]] = {}
    for stats in files:
        entries = {e.name: e for e in stats.tensors if e.encoding is not None and e.skipped is None}
        for name, task in plan.work.get(stats.path, {}).items():
            entry, found = entries.get(name), stats.findings.get(name)
            if entry is None or entry.encoding is None or task.scale is None or found is None \
                    or entry.encoding.factors != "any" or not entry.encoding.rescaled:
                continue
            scales = found.scales.get(entry.encoding.rescaled[0])
            if scales is None or not scales.largest:
                continue
            info = ml_dtypes.finfo(entry.dtype)
            factors = np.asarray(task.scale, np.float64)
            low, high = float(np.min(factors)), float(np.max(factors))
            if any(p[0] == entry.encoding.rescaled[0] and p[1] == "global scale" for p in entry.encoding.parts):
                low, high = min(low, 1 / high), max(high, 1 / low)  # a global scale may divide (compressed-tensors)
            if scales.smallest * low < float(info.tiny) or scales.largest * high > float(info.max):
                risky.setdefault(stats.path, {})[name] = task
    return risky


def _check_power_of_two(entry: TensorEntry, factors: np.ndarray, found: Findings | None, where: object) -> None:
    for factor in factors:
        factor = float(factor)
        if factor == 1.0:
            continue
        if not is_power_of_two(factor):
            raise UnsupportedError((f"tensor {_describe(entry)} has E8M0 scales, which hold powers of two only: "
                                    f"the factor {factor:.6g} cannot be applied exactly by rewriting them (only "
                                    f"2**k can; requantizing the codes is not done); nothing was written. Leave it "
                                    "out with ", Option.EXCLUDE, " or clip with a norm that gives a power of two"),
                                   where)
        if found is None:
            continue
        for scales in found.scales.values():
            if scales.largest and (scales.largest * factor > 2.0 ** 127 or scales.smallest * factor < 2.0 ** -127):
                raise UnsupportedError(f"tensor {_describe(entry)}: the factor {factor:.6g} takes an E8M0 scale out "
                                       "of its range 2**-127..2**127; nothing was written", where)


def _fused_key(name: str) -> str | None:
    """The module a fused group's member belongs to, with the member's place in the group."""
    for group in _FUSED:
        for member in group:
            match = re.match(rf"(.*[._]){re.escape(member)}(\.weight)?$", name)
            if match:
                return match.group(1) + "|".join(group)
    return None


def _check_fused(plan: Plan, files: list[FileStats], fused: dict[tuple[str, float], list[tuple[str, float]]],
                 where: object) -> None:
    """NVFP4 weights of one fused group share their global scale: they must keep sharing it."""
    unclipped: dict[str, float] = {}
    for stats in files:
        for entry in stats.tensors:
            if entry.encoding is None or entry.skipped is not None:
                continue
            found = stats.findings.get(entry.name)
            if found is None or found.global_value is None or entry.name in plan.work.get(stats.path, {}):
                continue
            if any(p[1] == "global scale" for p in entry.encoding.parts):
                unclipped[entry.name] = found.global_value
    left_out = {name: value for stats in files for name, value in stats.global_scales.items()}
    for (key, value), members in fused.items():
        excluded = sorted(n for n, v in left_out.items() if v == value and _fused_key(n) == key)
        if excluded:
            clipped = ", ".join(repr(n) for n, _ in sorted(members))
            raise UnsupportedError((f"tensor {excluded[0]!r}" + (f" (and {len(excluded) - 1} more)" if
                                    len(excluded) > 1 else "") + " is left out of the selection, but it shares "
                                    f"one NVFP4 global scale with {clipped} (a fused group, which vLLM loads with "
                                    "one global scale for all): clipping only part of the group would give it "
                                    "different global scales; nothing was written. Select the group whole, or "
                                    "leave all of it out with ", Option.EXCLUDE), where)
        siblings = [n for n, v in unclipped.items() if v == value and _fused_key(n) == key]
        factors = {"nan" if math.isnan(f) else f for _, f in members} | ({1.0} if siblings else set())
        if len(factors) > 1:
            names = sorted([n for n, _ in members] + siblings)
            shown = ", ".join(f"{n} x{f:.6g}" for n, f in sorted(members)) + "".join(f", {n} x1" for n in siblings)
            raise UnsupportedError((f"tensors {', '.join(repr(n) for n in names)} share one NVFP4 global scale (a "
                                    "fused group, which vLLM loads with one global scale for all): clipping them by "
                                    f"different factors ({shown}) would not survive loading; nothing was written. "
                                    "Clip them with one factor (global clipping), or leave them out with ",
                                    Option.EXCLUDE), where)


# --------------------------------------------------------------------------- what reports say


def _position(found: Findings, index: int) -> str:
    if not found.shape:
        return ""
    where = [int(i) for i in np.unravel_index(index, found.shape)]
    if len(where) >= 2:
        return f"row {where[-2] if len(where) == 2 else tuple(where[:-1])}, column {where[-1]}"
    return f"element {where[0]}"


def _block(scales: Any, index: int) -> str:
    """``block [i, j]`` (or ``block i``) of a scale, empty for a tensor's one scale."""
    if index < 0 or math.prod(scales.shape) <= 1:
        return ""
    where = scales.where(index)
    return f"block {where if len(where) > 1 else where[0]}"


def _scale_detail(found: Findings) -> list[str]:
    parts = []
    for scales in found.scales.values():
        if scales.nan or scales.inf:
            kinds = "/".join(k for k, n in (("NaN", scales.nan), ("Inf", scales.inf)) if n)
            count = scales.nan + scales.inf
            at = _block(scales, scales.first_bad)
            parts.append(f"{count} {kinds} scale(s) in {scales.part}" + (f", first at {at}" if at else "")
                         if count > 1 else f"{kinds} scale in {scales.part}" + (f" {at}" if at else ""))
    return parts


def nonfinite_detail(found: Findings | None) -> str:
    """Where a quantized weight's NaN/Inf come from, e.g. ``NaN scale in X.weight_scale_inv
    block [0, 1]``, ``NaN code at row 3, column 17`` (empty when nothing is known)."""
    if found is None:
        return ""
    parts = _scale_detail(found)
    if found.nan_codes or found.inf_codes:
        count = found.nan_codes + found.inf_codes
        kinds = "/".join(k for k, n in (("NaN", found.nan_codes), ("Inf", found.inf_codes)) if n)
        at = _position(found, found.first_bad_code) if found.first_bad_code >= 0 else ""
        parts.append(f"{count} {kinds} code(s) in {found.codes}" + (f", first at {at}" if at else ""))
    return "; ".join(parts)


def quantized_notes(files: list[FileStats]) -> list[Note]:
    """Warnings about quantized weights, per weight with the count: NaN/Inf scales (shown by
    every report, not only by a failed ``max_norm`` check: scanning them is cheap) and zero
    scales (dead blocks)."""
    notes = []
    for stats in files:
        for name, found in stats.findings.items():
            bad = _scale_detail(found)
            if bad:
                notes.append(Note(NoteKind.NONFINITE_SCALES, f"{name}: {'; '.join(bad)}"))
            for scales in found.scales.values():
                if scales.zero:
                    at = _block(scales, scales.first_zero)
                    notes.append(Note(NoteKind.ZERO_SCALES,
                                      f"{name}: {scales.zero} zero scale(s) in {scales.part} (dead blocks: their "
                                      "values are all 0)" + (f", first at {at}" if at else "")))
    return notes


def quantization_json(entry: Any, found: Findings | None) -> dict[str, Any]:
    """The ``quantization`` object of a weight in JSON reports."""
    summary = entry.encoding
    data: dict[str, Any] = {
        "scheme": summary.scheme,
        "convention": summary.convention,
        "parts": [{"name": n, "role": r, "dtype": d, "shape": list(s)} for n, r, d, s in summary.parts],
    }
    if summary.problem is not None:
        data["problem"] = summary.problem
    if found is not None:
        data["nan_codes"], data["inf_codes"] = found.nan_codes, found.inf_codes
        if found.first_bad_code >= 0:
            data["first_bad_code"] = [int(i) for i in np.unravel_index(found.first_bad_code, found.shape)]
        data["scales"] = [{"name": s.part, "count": s.count, "nan": s.nan, "inf": s.inf, "zero": s.zero,
                           "first_bad": s.where(s.first_bad) if s.first_bad >= 0 else None,
                           "first_zero": s.where(s.first_zero) if s.first_zero >= 0 else None,
                           "smallest": s.smallest if math.isfinite(s.smallest) else None,
                           "largest": s.largest if s.count else None} for s in found.scales.values()]
    return data
