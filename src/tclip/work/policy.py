"""What is refused, or warned about, before any data is read (and NaN/Inf after pass 1): one
set of checks for one file and for a tensor set."""

from __future__ import annotations

from ..core.dtypes import is_floating
from ..core.modes import Mode
from ..errors import NonFiniteError, TclipError, UnsupportedError
from ..messages import Option
from ..text import name_list, natural_key
from .options import ClipOptions
from .quantized import describe, scale_companions
from .reporting import optimizer_note, unmatched_note
from .results import FileReport, Note, NoteKind
from .selection import Selection, SkipKind, TensorEntry, is_rank_skip


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
    raise UnsupportedError((f"tensor {describe(weight, scales)}{more} is a quantized weight: its real values are "
                            "codes times scales, and clipping codes or scales as plain values would destroy it; "
                            "tclip does not clip quantized weights yet; nothing was written. Leave them out "
                            "with ", Option.EXCLUDE, " to clip the rest"), path)


def check_selection(entries: list[TensorEntry], names: list[str], mode: Mode, options: ClipOptions,
                    where: object, what: str = "file") -> list[Note]:
    """What is refused before any data is read, for a file or a tensor set alike (raises),
    and the warnings that go with what is not refused (returned).

    ``entries``: every tensor with its skip reason (:func:`~tclip.work.selection.select`);
    ``names``: every tensor name of the file or set (for quantized weights and
    patterns that match nothing); ``what``: "file" or "set", for messages.
    """
    selection = options.selection
    refuse_quantized(names, selection, where)
    refused = [e for e in entries if e.skipped is not None and e.skipped.kind is SkipKind.REFUSED
               and is_floating(e.dtype)]
    if refused:
        first = refused[0]
        more = f" (and {len(refused) - 1} more)" if len(refused) > 1 else ""
        raise UnsupportedError((f"tensor {first.name!r}{more}: {first.skipped}; nothing was written. "
                                "Leave such tensors out with ", Option.EXCLUDE, " to clip the rest"), where)
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


def _tensors(count: int) -> str:
    return f"{count:,} tensor" if count == 1 else f"{count:,} tensors"


def _by_reason(entries: list[TensorEntry]) -> str:
    """``a, b, c and 46 more (rank 1 has no axis 1)``: each reason once, after a few of its
    names in natural order, so the line stays one line for 51 layernorms (issue 20.11)."""
    groups: dict[str, list[str]] = {}
    for e in sorted(entries, key=lambda e: natural_key(e.name)):
        groups.setdefault(str(e.skipped), []).append(e.name)
    return "; ".join(f"{name_list(names)} ({reason})" for reason, names in groups.items())


def _axes_text(axes: object) -> str:
    if axes is None:
        return ""
    return ",".join(str(a) for a in ([axes] if isinstance(axes, int) else axes))  # type: ignore[union-attr]


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
        parts.append(f"{t.name} ({', '.join(counts)})")
    shown = name_list(parts, total=len(bad))
    raise NonFiniteError(("NaN/Inf values in " + shown + "; nothing was written (", Option.PROPAGATE,
                          " clips them as TensorFlow does)"), where)
