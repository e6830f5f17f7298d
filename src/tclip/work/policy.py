"""What is refused, or warned about, before any data is read (and NaN/Inf after pass 1): one
set of checks for one file and for a tensor set."""

from __future__ import annotations

import math
from collections.abc import Sequence

from ..core.dtypes import dtype_name
from ..core.modes import Mode
from ..core.stats import Axes
from ..errors import NonFiniteError, TclipError, UnsupportedError
from ..formats.base import OtherObject
from ..messages import Option
from ..text import name_list, natural_key
from .options import ClipOptions
from .quantized import check_quantized_selection
from .reporting import optimizer_note, unmatched_note
from .results import FileReport, Note, NoteKind
from .selection import SkipKind, TensorEntry, is_rank_skip


def check_selection(entries: list[TensorEntry], names: list[str], mode: Mode, options: ClipOptions,
                    where: object, what: str = "file", unreadable: Sequence[OtherObject] = ()) -> list[Note]:
    """What is refused before any data is read, for a file or a tensor set alike (raises),
    and the warnings that go with what is not refused (returned).

    ``entries``: every tensor with its skip reason (:func:`~tclip.work.selection.select`);
    ``names``: every tensor name of the file or set (for patterns that match nothing);
    ``what``: "file" or "set", for messages; ``unreadable``: the selected objects of a type
    tclip cannot read (a GGUF tensor of an unknown ggml type, HDF5 quad floats). Quantized
    weights that cannot be clipped as asked are refused here
    (:func:`~tclip.work.quantized.check_quantized_selection`), and so is any selected tensor
    left unread that may hold floats: a clip never passes over what it could not process.
    """
    selection = options.selection
    check_quantized_selection(entries, mode, where)
    _check_unread(entries, unreadable, where)
    notes = []
    rank_skips = [e for e in entries if is_rank_skip(e.skipped)]
    if rank_skips:
        listing = _by_reason(rank_skips)
        if options.strict:
            raise TclipError((Option.AXES, f" does not fit {len(rank_skips)} tensor(s): {listing}"), where)
        if not any(e.skipped is None for e in entries):
            raise TclipError((Option.AXES, f" {_axes_text(getattr(mode, 'axes', None))} fits no tensor of the "
                                           f"{what} ({listing}); nothing was written"), where)
        notes.append(Note(NoteKind.AXES_SKIPPED, f"{_tensors(len(rank_skips))} left unchanged: {listing}"))
    notes += [unmatched_note(pattern) for pattern in selection.unmatched(names)]
    optimizer = optimizer_note([e.name for e in entries
                                if e.skipped is not None and e.skipped.kind is SkipKind.OPTIMIZER_STATE], False)
    if optimizer:
        notes.append(optimizer)
    if not any(e.skipped is None for e in entries):
        notes.append(Note(NoteKind.NOTHING_SELECTED, "no floating-point tensor selected; the output is a copy"))
    return notes


def _check_unread(entries: list[TensorEntry], unreadable: Sequence[OtherObject], where: object) -> None:
    """Refuse a clip selecting a tensor it would leave unread although it may hold floats."""
    refused = [e for e in entries if e.unread_floats and e.skipped is not None and e.skipped.kind is SkipKind.REFUSED]
    if refused:
        first = refused[0]
        more = f" (and {len(refused) - 1} more)" if len(refused) > 1 else ""
        raise UnsupportedError((f"tensor {first.name!r}{more}: {first.skipped}; nothing was written. "
                                "Leave such tensors out with ", Option.EXCLUDE, " to clip the rest"), where)
    unread = [(e.name, e.dtype_label or dtype_name(e.dtype)) for e in entries if e.unread_floats]
    unread += [(o.name, f"{o.kind}: {o.reason}") for o in unreadable]
    if unread:
        name, why = unread[0]
        more = f" (and {len(unread) - 1} more)" if len(unread) > 1 else ""
        raise UnsupportedError((f"tensor {name!r}{more} is of a type tclip cannot read ({why}) and may hold "
                                "floating-point values; nothing was written. Leave it out with ", Option.EXCLUDE,
                                " to clip the rest"), where)


def _tensors(count: int) -> str:
    return f"{count:,} tensor" if count == 1 else f"{count:,} tensors"


def _by_reason(entries: list[TensorEntry]) -> str:
    """``a, b, c and 46 more (rank 1 has no axis 1)``: each reason once, after a few of its
    names in natural order, so the line stays one line for 51 layernorms (issue 20.11)."""
    groups: dict[str, list[str]] = {}
    for e in sorted(entries, key=lambda e: natural_key(e.name)):
        groups.setdefault(str(e.skipped), []).append(e.name)
    return "; ".join(f"{name_list(names)} ({reason})" for reason, names in groups.items())


def _axes_text(axes: Axes) -> str:
    if axes is None:
        return ""
    return ",".join(str(a) for a in axes)


def check_norm_overflow(report: FileReport, options: ClipOptions, where: object) -> None:
    """Refuse norms that overflow float64 over finite values (``[3e200, 1.0]``), unless the policy
    is to propagate: their factor would be ``c / inf`` (zeros; NaN for the global norm) while the
    real norm may lie below the limit, where README promises tensors unchanged. An infinite limit
    needs no norm (its factor is 1)."""
    clip = report.params.get("clip")
    if options.nonfinite != "error" or not isinstance(clip, float | int) or math.isinf(clip):
        return
    if report.params.get("use_norm") is not None:
        return
    measured = [t for t in report.tensors if t.skipped is None and not t.nonfinite]
    bad = [t for t in measured
           if any(v is not None and math.isinf(v) for v in (t.norm, t.max_slice_norm))]
    if not bad and report.mode == "global":
        squares = math.fsum((t.counted_norm if t.counted_norm is not None else t.norm or 0.0) ** 2
                            for t in measured if t.norm is not None and math.isfinite(t.norm))
        if math.isinf(squares):
            bad = sorted(measured, key=lambda t: -(t.norm or 0.0))
    if not bad:
        return
    names = name_list([t.name for t in sorted(bad, key=lambda t: natural_key(t.name))][:3], total=len(bad))
    raise NonFiniteError((f"the L2 norm of {names} overflows float64 (its squares sum past 1.8e308) though "
                          "its values are finite: tclip cannot tell whether it is above the limit; nothing was "
                          "written (", Option.PROPAGATE, " applies TensorFlow's arithmetic: a factor of 0, or NaN "
                          "for the global norm)"), where)


def check_nonfinite(report: FileReport, options: ClipOptions, where: object) -> None:
    """Refuse NaN/Inf in the tensors worked on, unless the policy is to propagate them."""
    if options.nonfinite != "error":
        return
    bad = sorted((t for t in report.tensors if t.skipped is None and t.nonfinite), key=lambda t: natural_key(t.name))
    if not bad:
        return
    parts = []
    for t in bad[:3]:
        counts = [f"{n:,} {label}" for n, label in ((t.nan, "NaN"), (t.inf, "Inf")) if n]
        detail = f": {t.nonfinite_where}" if t.nonfinite_where else ""  # a quantized weight: codes or scales
        parts.append(f"{t.name} ({', '.join(counts)}{detail})")
    shown = name_list(parts, total=len(bad))
    raise NonFiniteError(("NaN/Inf values in " + shown + "; nothing was written (", Option.PROPAGATE,
                          " clips them as TensorFlow does)"), where)
