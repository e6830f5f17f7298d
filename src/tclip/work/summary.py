"""``report --summary``'s data: files in natural order, each one's largest tensor, and the
tensors whose norm changed most between consecutive files."""

from __future__ import annotations

import math
from typing import Any

from ..messages import Naming, library_name, spelled
from ..text import natural_key
from .results import SCHEMA_VERSION, FileReport, json_safe

TOP_CHANGES = 10


def in_natural_order(reports: list[FileReport]) -> list[FileReport]:
    return sorted(reports, key=lambda r: natural_key(r.file))


def largest_tensor(report: FileReport) -> tuple[str | None, float | None]:
    measured = [t for t in report.tensors if t.norm is not None]
    if not measured:
        return None, None
    bad = [t for t in measured if t.nonfinite or math.isnan(t.norm)]  # type: ignore[arg-type]
    top = bad[0] if bad else max(measured, key=lambda t: t.norm)  # type: ignore[arg-type,return-value]
    return top.name, top.norm


def changes(previous: FileReport, current: FileReport, top: int = TOP_CHANGES) -> list[dict[str, Any]]:
    """Tensors of both files ranked by how much their norm changed (NaN/Inf appearing first)."""
    before = {t.name: t for t in previous.tensors if t.norm is not None}
    out = []
    for t in current.tensors:
        old = before.get(t.name)
        if old is None or t.norm is None or old.norm is None:
            continue
        new_bad = bool(t.nonfinite) and not old.nonfinite
        if old.norm > 0 and t.norm > 0 and math.isfinite(old.norm) and math.isfinite(t.norm):
            ratio = t.norm / old.norm
            score = abs(math.log(ratio))
        elif old.norm == t.norm:
            ratio, score = 1.0, 0.0
        else:
            ratio = math.inf if old.norm == 0 else math.nan
            score = math.inf
        if new_bad:
            score = math.inf
        if score > 0:
            out.append({"name": t.name, "norm_before": old.norm, "norm_after": t.norm, "ratio": ratio,
                        "nonfinite_appeared": new_bad, "_score": score})
    out.sort(key=lambda c: (-c["_score"], natural_key(c["name"])))
    for item in out:
        del item["_score"]
    return out[:top]


def summary_json(reports: list[FileReport], name: Naming = library_name) -> list[dict[str, Any]]:
    """One object per file, in natural order, with the changes since the previous file."""
    items = []
    ordered = in_natural_order(reports)
    for i, report in enumerate(ordered):
        name, norm = largest_tensor(report)
        bad = [t for t in report.tensors if t.nonfinite]
        items.append(json_safe({
            "schema": SCHEMA_VERSION,
            "mode": "summary",
            "file": report.file,
            "global_norm": report.global_norm,
            "tensors": len(report.tensors),
            "largest": {"name": name, "norm": norm},
            "nonfinite": {"tensors": [t.name for t in bad], "nan": sum(t.nan for t in bad),
                          "inf": sum(t.inf for t in bad)},
            "previous": ordered[i - 1].file if i else None,
            "changes": changes(ordered[i - 1], report) if i else [],
            "warnings": [spelled(w, name) for w in report.warnings],
        }))
    return items
