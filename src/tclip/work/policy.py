"""What is refused, or warned about, before any data is read (and NaN/Inf after pass 1)."""

from __future__ import annotations

from pathlib import Path

from ..core.modes import Mode
from ..core.dtypes import is_floating
from ..errors import NonFiniteError, TclipError, UnsupportedError
from ..formats import TensorReader
from ..formats.sharded import TensorSet
from .options import ClipOptions
from .quantized import describe, scale_companions
from .results import FileReport
from .selection import Selection, TensorEntry, is_rank_skip
from .statistics import FileStats


def refuse_quantized(names: list[str], selection: Selection, path: object) -> None:
    """Refuse to clip a quantized weight (codes plus scale tensors) as if it were plain values.

    Multiplying the codes rounds them again and multiplying codes and scales
    scales the real weight twice: the model would be destroyed. Until tclip
    clips such weights by their scales, a selected code or scale tensor is an error.
    """
    pairs = scale_companions(names)
    hit = [(weight, scales) for weight, scales in pairs.items()
           if any(selection.matches(n) for n in (weight, *scales))]
    if not hit:
        return
    weight, scales = hit[0]
    more = f" (and {len(hit) - 1} more quantized weight(s))" if len(hit) > 1 else ""
    raise UnsupportedError(f"tensor {describe(weight, scales)}{more} is a quantized weight: its real values are "
                           "codes times scales, and clipping codes or scales as plain values would destroy it; "
                           "tclip does not clip quantized weights yet; nothing was written. Leave them out "
                           "with --exclude to clip the rest", path)


def header_checks(reader: TensorReader, entries: list[TensorEntry], mode: Mode, options: ClipOptions,
                  path: Path, warnings: list[str]) -> None:
    """What can be refused from the header alone, before any data is read."""
    selection = options.selection
    refuse_quantized(list(reader.tensors), selection, path)
    refused = [info for info in reader.tensors.values()
               if info.refused and selection.matches(info.name) and is_floating(info.dtype)]
    if refused:
        first = refused[0]
        more = f" (and {len(refused) - 1} more)" if len(refused) > 1 else ""
        raise UnsupportedError(f"tensor {first.name!r}{more}: {first.refused}; nothing was written. "
                               "Leave such tensors out with --exclude to clip the rest", path)
    rank_skips = [e for e in entries if is_rank_skip(e.skipped)]
    if rank_skips:
        listing = ", ".join(f"{e.name} ({e.skipped})" for e in rank_skips[:20])
        if len(rank_skips) > 20:
            listing += f" and {len(rank_skips) - 20} more"
        if options.strict:
            raise TclipError(f"--axes does not fit {len(rank_skips)} tensor(s): {listing}", path)
        if not any(e.skipped is None for e in entries):
            raise TclipError(f"--axes {_axes_text(getattr(mode, 'axes', None))} fits no tensor of the file "
                             f"({listing}); nothing was written", path)
        warnings.append(f"{len(rank_skips)} tensor(s) left unchanged: {listing}")
    for pattern in selection.unmatched(list(reader.tensors)):
        warnings.append(f"pattern {pattern!r} matches no tensor")
    if not any(e.skipped is None for e in entries):
        warnings.append("no floating-point tensor selected; the output is a copy")


def _axes_text(axes: object) -> str:
    if axes is None:
        return ""
    return ",".join(str(a) for a in ([axes] if isinstance(axes, int) else axes))  # type: ignore[union-attr]


def nonfinite_message(report: FileReport) -> str:
    parts = []
    for t in report.tensors:
        if t.skipped is None and t.nonfinite:
            counts = [f"{n} {label}" for n, label in ((t.nan, "NaN"), (t.inf, "Inf")) if n]
            parts.append(f"{t.name} ({', '.join(counts)})")
    shown = ", ".join(parts[:10]) + (f" and {len(parts) - 10} more" if len(parts) > 10 else "")
    return ("NaN/Inf values in " + shown + "; nothing was written "
            "(--nonfinite propagate clips them as TensorFlow does)")


def set_checks(report: FileReport, stats: list[FileStats], options: ClipOptions, tensor_set: TensorSet) -> None:
    names = [t.name for t in report.tensors]
    for pattern in options.selection.unmatched(names):
        report.warnings.append(f"pattern {pattern!r} matches no tensor")
    rank_skips = [t for t in report.tensors if is_rank_skip(t.skipped)]
    if rank_skips:
        listing = ", ".join(f"{t.name} ({t.skipped})" for t in rank_skips[:20])
        if options.strict:
            raise TclipError(f"--axes does not fit {len(rank_skips)} tensor(s): {listing}", tensor_set.name)
        report.warnings.append(f"{len(rank_skips)} tensor(s) left unchanged: {listing}")
    refused = [t for t in report.tensors if t.skipped and ("external storage" in t.skipped
                                                             or "virtual dataset" in t.skipped)]
    if refused:
        raise UnsupportedError(f"tensor {refused[0].name!r}: {refused[0].skipped}; nothing was written",
                               tensor_set.name)
    if options.nonfinite == "error" and any(t.nonfinite for t in report.tensors if t.skipped is None):
        raise NonFiniteError(nonfinite_message(report), tensor_set.name)
