"""``report --summary``'s data: files in natural order (or as given), each one's largest
tensor, the tensors whose norm changed most between consecutive files (of one series:
a step folder's model file after the previous folder's), those in which NaN/Inf appeared
or went, and the labels that tell the files apart."""

from __future__ import annotations

import enum
import math
import os
import re
from typing import Any

from ..messages import Naming, library_name, spelled
from ..text import natural_key
from .results import SCHEMA_VERSION, FileReport, json_safe

TOP_CHANGES = 10


def in_natural_order(reports: list[FileReport]) -> list[FileReport]:
    return sorted(reports, key=lambda r: natural_key(r.file))


def in_step_order(reports: list[FileReport], sort: str = "name") -> list[FileReport]:
    """The order "consecutive" means: natural order of the paths, or as given (``sort="order"``),
    each series (:func:`series_of`) together, in the order they first appear."""
    steps = list(reports) if sort == "order" else in_natural_order(reports)
    series = series_of(steps)
    first: dict[str, int] = {}
    for report in steps:
        first.setdefault(series[id(report)], len(first))
    return sorted(steps, key=lambda r: first[series[id(r)]])


def series_of(reports: list[FileReport]) -> dict[int, str]:
    """Which series each report is a step of (by ``id``). Step folders -- a Trainer's
    ``checkpoint-100/`` with ``model.safetensors``, ``optimizer.pt`` and ``scheduler.pt`` --
    give one series per file name, so the model's rows follow the model and the optimizer's
    the optimizer; step files (``run/step_*.safetensors``) are one series."""
    folders: dict[str, set[str]] = {}
    for report in reports:
        folder, name = os.path.split(report.file)
        folders.setdefault(name, set()).add(folder)
    stepped = any(len(where) > 1 for where in folders.values())
    return {id(r): os.path.basename(r.file) if stepped else "" for r in reports}


def consecutive(steps: list[FileReport]) -> dict[int, FileReport | None]:
    """Each report's previous step in its series (by ``id``; None for a series' first)."""
    series = series_of(steps)
    last: dict[str, FileReport] = {}
    previous: dict[int, FileReport | None] = {}
    for report in steps:
        previous[id(report)] = last.get(series[id(report)])
        last[series[id(report)]] = report
    return previous


def in_row_order(reports: list[FileReport], sort: str = "name") -> list[FileReport]:
    """The rows: in step order, or by global norm, largest first (``sort="norm"``; NaN first)."""
    steps = in_step_order(reports, sort)
    if sort != "norm":
        return steps

    def key(r: FileReport) -> tuple[int, float]:
        g = r.global_norm
        if g is None:
            return (2, 0.0)
        return (0, 0.0) if math.isnan(g) else (1, -g)

    return sorted(steps, key=key)


_SEPARATORS = re.compile(r"[/" + re.escape(os.sep) + r"]")


def file_labels(paths: list[str]) -> dict[str, str]:
    """What tells each file apart from the others: the part of its path that differs.

    ``run/step_400.safetensors`` among ``run/step_*.safetensors`` is ``step_400`` (the
    shared folder and suffix go); ``trainer/checkpoint-700/model.safetensors`` among the
    Trainer's folders is ``checkpoint-700`` (the shared file name goes). Labels that would
    not be unique fall back to the whole paths.
    """
    if not paths:
        return {}
    parts = {p: [c for c in _SEPARATORS.split(p)] for p in dict.fromkeys(paths)}
    lists = list(parts.values())
    shortest = min(len(c) for c in lists)
    lead = 0
    while lead < shortest - 1 and len({c[lead] for c in lists}) == 1:
        lead += 1
    trail = 0
    while trail < shortest - lead - 1 and len({c[len(c) - 1 - trail] for c in lists}) == 1:
        trail += 1
    middle = {p: c[lead:len(c) - trail] for p, c in parts.items()}
    labels = {p: "/".join(m) for p, m in middle.items()}
    if trail == 0:
        # The file names differ: a suffix they all share (.safetensors) tells nothing apart.
        names = [m[-1] for m in middle.values()]
        suffixes = {n[n.rfind("."):] if "." in n[1:] else "" for n in names}
        suffix = suffixes.pop() if len(suffixes) == 1 else ""
        if suffix:
            labels = {p: label[: len(label) - len(suffix)] for p, label in labels.items()}
    if len(set(labels.values())) != len(labels) or not all(labels.values()):
        return {p: p for p in paths}
    return labels


def largest_tensor(report: FileReport) -> tuple[str | None, float | None]:
    measured = [(t.norm, t) for t in report.tensors if t.norm is not None]
    if not measured:
        return None, None
    bad = [t for norm, t in measured if t.nonfinite or math.isnan(norm)]
    top = bad[0] if bad else max(measured, key=lambda pair: pair[0])[1]
    return top.name, top.norm


class ChangeKind(str, enum.Enum):
    """How a tensor's norm changed between two files (the JSON's ``kind``)."""

    RATIO = "ratio"  # both norms finite and non-zero: by the factor ``ratio``
    FROM_ZERO = "from_zero"
    TO_ZERO = "to_zero"


def nonfinite_events(previous: FileReport, current: FileReport) -> tuple[list[str], list[str]]:
    """The tensors of both files in which NaN/Inf appeared, and those it left, in natural order.
    NaN/Inf that stays from one file to the next is neither: nothing changed that a norm shows."""
    before = {t.name: t for t in previous.tensors if t.norm is not None}
    appeared, gone = [], []
    for t in current.tensors:
        old = before.get(t.name)
        if old is None or t.norm is None:
            continue
        if t.nonfinite and not old.nonfinite:
            appeared.append(t.name)
        elif old.nonfinite and not t.nonfinite:
            gone.append(t.name)
    return sorted(appeared, key=natural_key), sorted(gone, key=natural_key)


def _finite(t: Any) -> bool:
    return t.norm is not None and not t.nonfinite and math.isfinite(t.norm)


def changes(previous: FileReport, current: FileReport, top: int = TOP_CHANGES) -> list[dict[str, Any]]:
    """The ``top`` tensors of both files whose finite norm changed most (by the factor of change;
    from or to 0 first). NaN/Inf appearing or going is an event of its own (:func:`nonfinite_events`):
    grouped, it never fills the list and pushes a real change out."""
    before = {t.name: t.norm for t in previous.tensors if _finite(t)}
    scored: list[tuple[float, dict[str, Any]]] = []
    for t in current.tensors:
        old = before.get(t.name)
        new = t.norm
        if old is None or new is None or not _finite(t) or old == new:
            continue
        if old > 0 and new > 0:
            ratio, kind = new / old, ChangeKind.RATIO
            score = abs(math.log(ratio))
        else:
            ratio, kind = (math.inf, ChangeKind.FROM_ZERO) if old == 0 else (0.0, ChangeKind.TO_ZERO)
            score = math.inf
        if score > 0:
            scored.append((score, {"name": t.name, "norm_before": old, "norm_after": new, "ratio": ratio,
                                   "kind": kind.value}))
    scored.sort(key=lambda c: (-c[0], natural_key(c[1]["name"])))
    out = [item for _, item in scored]
    return out[:top]


def consecutive_pairs(steps: list[FileReport]) -> list[tuple[FileReport, FileReport]]:
    """(previous, file) for every file of ``steps`` (in step order) that has a previous step in
    its series (:func:`consecutive`)."""
    before = consecutive(steps)
    return [(previous, report) for report in steps if (previous := before[id(report)]) is not None]


def largest_changes(steps: list[FileReport], top: int = TOP_CHANGES) -> list[tuple[dict[str, Any], str, str]]:
    """(change, previous file, file) of the ``top`` largest changes between consecutive files
    (in step order), largest first; ties in step order."""
    moves = []
    for position, (previous, current) in enumerate(consecutive_pairs(steps)):
        for change in changes(previous, current, top):
            ratio = change["ratio"]
            score = abs(math.log(ratio)) if change["kind"] == ChangeKind.RATIO.value else math.inf
            moves.append((-score, position, change, previous.file, current.file))
    moves.sort(key=lambda m: (m[0], m[1]))
    return [(change, a, b) for _, _, change, a, b in moves[:top]]


def summary_json(reports: list[FileReport], name: Naming = library_name, *, sort: str = "name",
                 top: int = TOP_CHANGES) -> list[dict[str, Any]]:
    """One object per file, in row order (see :func:`in_row_order`), with the ``top``
    largest changes since the previous file in step order."""
    items = []
    previous = consecutive(in_step_order(reports, sort))
    for report in in_row_order(reports, sort):
        before = previous[id(report)]
        largest, norm = largest_tensor(report)
        bad = [t for t in report.tensors if t.nonfinite]
        events = nonfinite_events(before, report) if before is not None else ([], [])
        items.append(json_safe({
            "schema": SCHEMA_VERSION,
            "mode": "summary",
            "file": report.file,
            "global_norm": report.global_norm,
            "tensors": len(report.tensors),
            "tensors_not_measured": report.not_measured_count,
            "largest": {"name": largest, "norm": norm},
            "nonfinite": {"tensors": [t.name for t in bad], "nan": sum(t.nan for t in bad),
                          "inf": sum(t.inf for t in bad)},
            "previous": before.file if before is not None else None,
            "changes": changes(before, report, top) if before is not None else [],
            "nonfinite_appeared": events[0],
            "nonfinite_gone": events[1],
            "warnings": [spelled(w, name) for w in report.warnings],
            **(report.gate.to_json() if report.gate is not None else {}),
        }))
    return items
