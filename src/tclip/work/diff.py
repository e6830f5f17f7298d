"""Compare two tensor files (or tensor sets) tensor by tensor, block by block, in float64.

Tensors are matched by name (``--map OLD=NEW`` renames A's names first, ``*``
standing for any text). For each pair of the same shape both files are read in
step, unit by unit (:mod:`tclip.core.units`), and the differences are summed exactly,
so the numbers do not depend on the block size or the thread count:

- ``‖a−b‖₂``, ``‖a−b‖₂ / ‖a‖₂``, ``max |a−b|``, the cosine similarity;
- the elements *outside* ``|a−b| <= atol + rtol·|b|`` (``numpy.isclose``'s rule;
  with the default ``rtol = atol = 0``: every element whose value differs);
- NaN/Inf positions that differ: NaN equals NaN, an infinity equals the same
  infinity (as ``numpy.testing.assert_array_equal`` and ``h5diff`` with
  ``--use-system-epsilon`` treat them); the norms are over the positions where
  both values are finite.

Tensors of different dtypes are compared as values; 64-bit integers exactly, against
integers or floats (``2**53 + 1`` is not ``2**53``).
"""

from __future__ import annotations

import enum
import math
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from itertools import zip_longest
from pathlib import Path
from typing import Any

import numpy as np

from ..core.compare import DiffSums, compare_unit, identical_unit
from ..core.dtypes import is_bool, is_complex, is_floating
from ..core.kernels import Scratch
from ..errors import TclipError
from ..formats import TensorInfo, TensorReader
from ..formats.locks import shared_locks
from ..formats.sharded import is_index
from ..messages import Naming, Option, Tagged, library_name, spelled
from ..quant.view import open_any_logical
from ..text import name_list
from .budget import Budget
from .mapping import RenameRule, apply_mapping, suggest_mapping
from .metadata_diff import MetadataDifference, metadata_differences
from .passes import Block, pair_walk, run_pass
from .results import SCHEMA_VERSION, dtype_text, json_safe
from .selection import Selection


class Status(str, enum.Enum):
    """What became of a tensor name in a comparison (the value is the JSON's ``status``)."""

    COMPARED = "compared"
    ONLY_IN_A = "only in A"
    ONLY_IN_B = "only in B"
    SHAPE_DIFFERS = "shape differs"
    NOT_COMPARED = "not compared"

    def __str__(self) -> str:
        return self.value


# Statuses that make two files differ whatever the values.
UNMATCHED = (Status.ONLY_IN_A, Status.ONLY_IN_B, Status.SHAPE_DIFFERS)


class Verdict(str, enum.Enum):
    """The answer of a comparison (the JSON's ``verdict``): only ``SAME`` exits 0."""

    SAME = "same"
    DIFFER = "differ"
    INCOMPLETE = "incomplete"  # nothing differs, but something could not be compared

    def __str__(self) -> str:
        return self.value


class DiffNoteKind(enum.Enum):
    """What a comparison's warning is about."""

    UNMATCHED_RULE = "a rename rule matches no tensor of A"
    UNMATCHED_PATTERN = "a selection pattern matches no tensor"
    NO_PAIRS = "no tensor names pair up"
    METADATA_NOT_COMPARED = "one format holds no metadata"


class DiffNote(Tagged):
    """A warning of a comparison: its text (options in the library's words) and its :class:`DiffNoteKind`."""

    kind: DiffNoteKind


class RemarkKind(enum.Enum):
    """What a comparison's note says."""

    DTYPES_DIFFER = "compared as values, the dtypes differ"
    BYTES = "not numbers, compared by their stored bytes"
    AS_DATA = "not numbers, compared as data"
    REFUSED = "the format will not read it"
    NOT_NUMERIC = "not numbers, not compared"
    BOOL = "bool against numbers"
    NOT_A_TENSOR = "not a tensor, not compared"


class Remark(Tagged):
    """A note on one comparison: its text (the JSON's ``note``) and its :class:`RemarkKind`."""

    kind: RemarkKind


def _encoded_label(info: Any) -> str | None:
    """What a quantized weight's dtype column shows (its encoding's label: ``Q4_K``, ``e4m3 xf32 128x128``)."""
    return info.dtype_label if info.encoding is not None else None


@dataclass
class TensorDiff:
    """One matched pair (or a tensor only one side has).

    ``dtype_a``/``dtype_b``: the stored dtypes (text for what is not a tensor, as its file describes it);
    ``label_a``/``label_b``: how a quantized weight's encoding is shown instead (``Q4_K``), else None.
    """

    name: str
    name_b: str | None = None
    shape_a: list[int] | None = None
    shape_b: list[int] | None = None
    dtype_a: np.dtype | str | None = None
    dtype_b: np.dtype | str | None = None
    status: Status = Status.COMPARED
    elements: int = 0
    diff_norm: float | None = None
    relative: float | None = None
    max_abs_diff: float | None = None
    cosine: float | None = None
    norm_a: float | None = None
    norm_b: float | None = None
    outside: int = 0
    nonfinite_mismatch: int = 0
    note: Remark | None = None
    label_a: str | None = None
    label_b: str | None = None

    @property
    def differs(self) -> bool:
        if self.status in UNMATCHED:
            return True
        return self.outside > 0 or self.nonfinite_mismatch > 0


@dataclass
class DiffReport:
    """The comparison of two files: per tensor, lists of unmatched ones, global figures."""

    a: str
    b: str
    rtol: float
    atol: float
    tensors: list[TensorDiff] = field(default_factory=list)
    global_diff_norm: float = 0.0
    global_norm_a: float = 0.0
    bytes_read: int = 0
    elapsed_s: float = 0.0
    warnings: list[DiffNote] = field(default_factory=list)
    metadata_differences: list[MetadataDifference] = field(default_factory=list)
    files_hold_tensors: bool = False  # either file holds something to compare (whatever the selection)
    tensors_only: bool = False  # metadata differences are listed, not counted in the verdict

    @property
    def global_relative(self) -> float:
        if self.global_norm_a == 0:
            return 0.0 if self.global_diff_norm == 0 else math.inf
        return self.global_diff_norm / self.global_norm_a

    @property
    def differs(self) -> bool:
        """A tensor differs, is on one side only or has another shape, or metadata differs
        (unless ``tensors_only``)."""
        return self.metadata_counts or any(t.differs for t in self.tensors)

    @property
    def metadata_counts(self) -> bool:
        """Whether metadata differences make the files differ (they do, unless ``tensors_only``)."""
        return bool(self.metadata_differences) and not self.tensors_only

    @property
    def paired(self) -> int:
        """How many names were found on both sides (compared or not)."""
        return sum(t.status not in (Status.ONLY_IN_A, Status.ONLY_IN_B) for t in self.tensors)

    @property
    def verdict(self) -> Verdict:
        """``SAME`` only when everything was compared and is equal: a comparison never passes
        over what it could not compare, nor over files of which it compared nothing."""
        if self.differs:
            return Verdict.DIFFER
        if self.count(Status.NOT_COMPARED) or (self.files_hold_tensors and not self.paired):
            return Verdict.INCOMPLETE
        return Verdict.SAME

    @property
    def same(self) -> bool:
        return self.verdict is Verdict.SAME

    def count(self, status: Status) -> int:
        return sum(t.status is status for t in self.tensors)

    def summary_line(self, name: Naming = library_name) -> str:
        compared = [t for t in self.tensors if t.status is Status.COMPARED]
        differing = sum(t.differs for t in compared)
        parts = [f"{len(compared)} compared, {differing} differ"]
        for status in (*UNMATCHED, Status.NOT_COMPARED):
            n = self.count(status)
            if n:
                parts.append(f"{n} {status.value}")
        if self.metadata_differences:
            n = len(self.metadata_differences)
            parts.append(f"{n} metadata difference{'s' if n > 1 else ''}"
                         + (f" (not counted: {name(Option.TENSORS_ONLY)})" if self.tensors_only else ""))
        if compared:  # with nothing compared, a ‖A−B‖ of 0 would claim what was not measured
            parts.append(f"‖A−B‖ {self.global_diff_norm:.6g} ({self.global_relative:.3g} of ‖A‖)")
        return ", ".join(parts)

    def to_json(self, name: Naming = library_name) -> dict[str, Any]:
        tensors = []
        for t in self.tensors:
            item = asdict(t)
            del item["label_a"], item["label_b"]
            item["dtype_a"], item["dtype_b"] = dtype_text(t.dtype_a, t.label_a), dtype_text(t.dtype_b, t.label_b)
            item["status"] = t.status.value
            item["differs"] = t.differs
            tensors.append(item)
        return json_safe({
            "schema": SCHEMA_VERSION,
            "mode": "diff",
            "a": self.a,
            "b": self.b,
            "rtol": self.rtol,
            "atol": self.atol,
            "same": self.same,
            "verdict": self.verdict.value,
            "tensors_compared": self.count(Status.COMPARED),
            "tensors_differing": sum(t.differs for t in self.tensors),
            "only_in_a": [t.name for t in self.tensors if t.status is Status.ONLY_IN_A],
            "only_in_b": [t.name for t in self.tensors if t.status is Status.ONLY_IN_B],
            "shape_differs": [t.name for t in self.tensors if t.status is Status.SHAPE_DIFFERS],
            "not_compared": [{"name": t.name, "reason": t.note} for t in self.tensors
                             if t.status is Status.NOT_COMPARED],
            "metadata_differences": [asdict(d) for d in self.metadata_differences],
            "tensors_only": self.tensors_only,
            "global_diff_norm": self.global_diff_norm,
            "global_norm_a": self.global_norm_a,
            "global_relative": self.global_relative,
            "tensors": tensors,
            "bytes_read": self.bytes_read,
            "elapsed_s": round(self.elapsed_s, 6),
            "warnings": [spelled(w, name) for w in self.warnings],
        })


def _comparable(info: TensorInfo) -> bool:
    return info.numeric and not info.refused


def diff_files(a: Path | str, b: Path | str, *, rtol: float = 0.0, atol: float = 0.0,
               mapping: list[RenameRule] | None = None, selection: Selection | None = None,
               memory: int = Budget.memory, threads: int = 0, block_bytes: int | None = None,
               tensors_only: bool = False) -> "DiffReport":
    """Compare two files (or sharded sets, through their index) tensor by tensor.

    Args:
        a, b: any two supported files, of the same or different formats.
        rtol, atol: an element differs when ``|a-b| > atol + rtol*|b|``; the
            defaults (0) mean any difference in value.
        mapping: rename rules for A's tensors (:func:`tclip.work.mapping.parse_mapping`).
        selection: include/exclude globs, over A's (renamed) names.
        tensors_only: metadata and attribute differences are listed but do not make the
            files differ (an F32 GGUF against its safetensors source).

    Returns:
        A :class:`DiffReport`; ``differs`` is True when any tensor differs,
        is missing on one side or has another shape, or metadata differs (unless ``tensors_only``);
        ``verdict`` is ``SAME`` only when moreover everything was compared.

    Example:
        >>> report = diff_files("before.npz", "after.safetensors")  # doctest: +SKIP
        >>> report.differs, report.global_relative  # doctest: +SKIP
    """
    if rtol < 0 or atol < 0 or math.isnan(rtol) or math.isnan(atol):
        raise ValueError("rtol and atol must be >= 0")
    started = time.perf_counter()
    selection = selection or Selection()
    rules = mapping or []
    report = DiffReport(str(a), str(b), rtol, atol, tensors_only=tensors_only)
    # Quantized weights are compared as their real values, under their own names (scales are parts);
    # a set is read under a shared lock on its index (never half rewritten in place meanwhile).
    with shared_locks([Path(p) for p in (a, b) if is_index(Path(p))]), \
            open_any_logical(Path(a)) as reader_a, open_any_logical(Path(b)) as reader_b:
        for reader in (reader_a, reader_b):
            if reader.damage is not None:
                raise TclipError(reader.damage, reader.path)
        used: set[int] = set()  # the rules that renamed something
        pairs = _pair_up(reader_a, reader_b, _renamed(reader_a, rules, used, a), selection, report)
        _compare_pairs(reader_a, reader_b, pairs, report, Budget(memory, threads, block_bytes))
        _compare_others(reader_a, reader_b, rules, selection, report, memory, used)
        both = [(t.name, t.name_b or t.name) for t in report.tensors
                if t.status not in (Status.ONLY_IN_A, Status.ONLY_IN_B) and t.name in reader_a.tensors]
        whole = not (selection.include or selection.exclude)
        report.metadata_differences, compared = metadata_differences(reader_a, reader_b, both, whole)
        if not compared:
            report.warnings.append(DiffNote(DiffNoteKind.METADATA_NOT_COMPARED,
                                            "file metadata not compared: one of the formats holds none"))
        _check_names(reader_a, reader_b, rules, used, selection, report)
    _global_figures(report)
    report.elapsed_s = time.perf_counter() - started
    return report


def _renamed(reader_a: TensorReader, rules: list[RenameRule], used: set[int], a: Path | str) -> dict[str, str]:
    """A's tensors by their names after the rename rules (new name -> A's name); two given one name are refused."""
    renamed: dict[str, str] = {}
    for name in reader_a.tensors:
        new = _rename(name, rules, used)
        if new in renamed:
            raise TclipError((Option.MAP, f" gives two tensors of A the name {new!r}: {renamed[new]!r} and "
                                           f"{name!r}"),
                             a)
        renamed[new] = name
    return renamed


def _pair_up(reader_a: TensorReader, reader_b: TensorReader, renamed: dict[str, str], selection: Selection,
             report: "DiffReport") -> list[tuple[TensorDiff, str, str]]:
    """Each selected name's entry in ``report`` (only on one side, shape differs, not comparable:
    settled here); the pairs whose values are to be compared."""
    names_b = {n for n in reader_b.tensors if selection.matches(n)}
    pairs: list[tuple[TensorDiff, str, str]] = []
    for new, old in renamed.items():
        if not selection.matches(new):
            continue
        info_a = reader_a.tensors[old]
        entry = TensorDiff(old, new if new != old else None, list(info_a.shape), None, info_a.dtype,
                           label_a=_encoded_label(info_a))
        if new not in reader_b.tensors:
            entry.status = Status.ONLY_IN_A
            report.tensors.append(entry)
            continue
        names_b.discard(new)
        info_b = reader_b.tensors[new]
        entry.shape_b, entry.dtype_b, entry.label_b = list(info_b.shape), info_b.dtype, _encoded_label(info_b)
        if tuple(info_a.shape) != tuple(info_b.shape):
            entry.status = Status.SHAPE_DIFFERS
        elif not (_comparable(info_a) and _comparable(info_b)):
            entry.status = Status.NOT_COMPARED
            refused = info_a.refused or info_b.refused
            entry.note = Remark(RemarkKind.REFUSED, refused) if refused else \
                Remark(RemarkKind.NOT_NUMERIC, "not numeric")
            if _same_kind_of_bytes(info_a, info_b):
                _compare_bytes(reader_a, reader_b, entry, old, new, report)
        elif is_bool(info_a.dtype) != is_bool(info_b.dtype):
            entry.status = Status.NOT_COMPARED
            entry.note = Remark(RemarkKind.BOOL, "bool against numbers")
        else:
            pairs.append((entry, old, new))
        report.tensors.append(entry)
    for name in sorted(names_b):
        info_b = reader_b.tensors[name]
        report.tensors.append(TensorDiff(name, None, None, list(info_b.shape), None, info_b.dtype,
                                         Status.ONLY_IN_B))
    return pairs


def _global_figures(report: "DiffReport") -> None:
    """The global figures cover floating tensors, as the report's global norm does (a step
    counter would swamp them)."""
    compared = [t for t in report.tensors if t.status is Status.COMPARED and isinstance(t.dtype_a, np.dtype)
                and is_floating(t.dtype_a)]
    report.global_diff_norm = math.sqrt(math.fsum((t.diff_norm or 0.0) ** 2 for t in compared
                                                  if t.diff_norm is not None and math.isfinite(t.diff_norm)))
    report.global_norm_a = math.sqrt(math.fsum((t.norm_a or 0.0) ** 2 for t in compared
                                               if t.norm_a is not None and math.isfinite(t.norm_a)))


def _rename(name: str, rules: list[RenameRule], used: set[int]) -> str:
    """``name`` renamed by the first rule that matches it, noting which rule did."""
    for i, rule in enumerate(rules):
        renamed = rule.apply(name)
        if renamed is not None:
            used.add(i)
            return renamed
    return name


def _check_names(reader_a: TensorReader, reader_b: TensorReader, rules: list[RenameRule], used: set[int],
                 selection: Selection, report: "DiffReport") -> None:
    """Warn of rename rules and patterns that match nothing; when no name pairs up, say so
    and suggest the rename that would pair them."""
    for i, rule in enumerate(rules):
        if i not in used:
            report.warnings.append(DiffNote(DiffNoteKind.UNMATCHED_RULE,
                                            (Option.MAP, f" {rule.text!r} matches no tensor of A")))
    names_a = [*reader_a.tensors, *(o.name for o in reader_a.others)]
    names_b = [*reader_b.tensors, *(o.name for o in reader_b.others)]
    renamed = [apply_mapping(n, rules) for n in names_a]
    for pattern in selection.unmatched(renamed + names_b):
        report.warnings.append(DiffNote(DiffNoteKind.UNMATCHED_PATTERN,
                                        f"pattern {pattern!r} matches no tensor of A or B"))
    report.files_hold_tensors = bool(names_a or names_b)
    if report.paired or not (names_a and names_b):
        return
    only_a = [t.name for t in report.tensors if t.status is Status.ONLY_IN_A]
    only_b = [t.name for t in report.tensors if t.status is Status.ONLY_IN_B]
    message: tuple[str | Option, ...] = (f"no tensor names pair up (A: {name_list(only_a or names_a, 2)}; "
                                         f"B: {name_list(only_b or names_b, 2)})",)
    suggestion = suggest_mapping(list(reader_a.tensors), list(reader_b.tensors))
    if suggestion is not None:
        suggested, paired = suggestion
        message += ("; ", Option.MAP, f" {suggested!r} would pair {paired:,} of {len(reader_a.tensors):,}")
    report.warnings.append(DiffNote(DiffNoteKind.NO_PAIRS, message))


def _compare_others(reader_a: TensorReader, reader_b: TensorReader, rules: list[RenameRule],
                    selection: Selection, report: "DiffReport", memory: int, used: set[int]) -> None:
    """What is not a tensor (HDF5 string, compound, enum datasets, dimension scales): matched
    by name like tensors; equal when their values are (read as data, within ``memory``)."""
    others_b = {o.name: o for o in reader_b.others if selection.matches(o.name)}
    for other in reader_a.others:
        new = _rename(other.name, rules, used)
        if not selection.matches(new):
            continue
        entry = TensorDiff(other.name, new if new != other.name else None,
                           list(other.shape) if other.shape is not None else None, None, other.dtype)
        match = others_b.pop(new, None)
        if match is None:
            entry.status = Status.ONLY_IN_A
        else:
            entry.shape_b, entry.dtype_b = (list(match.shape) if match.shape is not None else None), match.dtype
            if entry.shape_a != entry.shape_b:
                entry.status = Status.SHAPE_DIFFERS
            else:
                entry.status, entry.note = Status.NOT_COMPARED, Remark(RemarkKind.NOT_A_TENSOR, other.kind)
                x, y = reader_a.other_values(other.name, memory), reader_b.other_values(new, memory)
                if x is not None and y is not None:
                    try:
                        differing = int(np.count_nonzero(np.asarray(x != y).reshape(-1))) if x.shape == y.shape \
                            else 1
                    except (TypeError, ValueError):
                        differing = -1
                    if differing >= 0 and x.dtype == y.dtype:
                        entry.status = Status.COMPARED
                        entry.note = Remark(RemarkKind.AS_DATA, f"not numbers ({other.kind}): compared as data")
                        entry.elements, entry.outside = int(x.size), differing
                        report.bytes_read += x.nbytes + y.nbytes
                if entry.status is Status.NOT_COMPARED:
                    _compare_other_bytes(reader_a, reader_b, entry, other.name, new, other.kind, report)
        report.tensors.append(entry)
    for name, other in sorted(others_b.items()):
        report.tensors.append(TensorDiff(name, None, None, list(other.shape) if other.shape is not None else None,
                                         None, other.dtype, Status.ONLY_IN_B))


def _same_kind_of_bytes(a: TensorInfo, b: TensorInfo) -> bool:
    """Data that is not numbers (strings, dates, opaque types, pickles) of one type on both sides."""
    return (not a.numeric and not b.numeric and not a.refused and not b.refused and a.dtype == b.dtype
            and a.dtype_label == b.dtype_label)


def _stream_difference(chunks_a: Iterator[bytes], chunks_b: Iterator[bytes], itemsize: int) -> tuple[int, int, int]:
    """(elements that differ, or 0/1 for one stream when ``itemsize`` is 0; bytes of A; bytes of B)."""
    differing, total_a, total_b = 0, 0, 0
    pending_a, pending_b = b"", b""
    try:
        for part_a, part_b in zip_longest(chunks_a, chunks_b, fillvalue=b""):
            total_a, total_b = total_a + len(part_a), total_b + len(part_b)
            pending_a, pending_b = pending_a + part_a, pending_b + part_b
            common = min(len(pending_a), len(pending_b))
            if itemsize:
                common -= common % itemsize
            if common:
                x = np.frombuffer(pending_a[:common], np.uint8)
                y = np.frombuffer(pending_b[:common], np.uint8)
                if itemsize:
                    differing += int(np.count_nonzero((x != y).reshape(-1, itemsize).any(axis=1)))
                elif not np.array_equal(x, y):
                    differing = 1
                pending_a, pending_b = pending_a[common:], pending_b[common:]
    finally:
        for chunks in (chunks_a, chunks_b):
            getattr(chunks, "close", lambda: None)()  # (a generator holding a file open)
    if pending_a != pending_b or total_a != total_b:
        differing = max(differing, 1)
    return differing, total_a, total_b


def _compare_other_bytes(reader_a: TensorReader, reader_b: TensorReader, entry: "TensorDiff", old: str, new: str,
                         kind: str, report: "DiffReport") -> None:
    """An object whose value tclip does not read (an item a DCP folder saved with ``torch.save``:
    a scheduler's ``lr_lambdas``, an rng state), compared by its stored bytes where both formats
    give them: equal bytes are the same object; other bytes are reported as differing (the
    writers tclip knows store one object as one stream of bytes: docs/dcp.md)."""
    if entry.dtype_a != entry.dtype_b:
        return
    chunks_a, chunks_b = reader_a.other_stored_bytes(old), reader_b.other_stored_bytes(new)
    if chunks_a is None or chunks_b is None:
        for chunks in (chunks_a, chunks_b):
            getattr(chunks, "close", lambda: None)()  # (a generator holding a file open)
        return
    differing, total_a, total_b = _stream_difference(chunks_a, chunks_b, 0)
    report.bytes_read += total_a + total_b
    entry.status, entry.elements, entry.outside = Status.COMPARED, 1, min(differing, 1)
    entry.note = Remark(RemarkKind.BYTES, f"not numbers ({kind}): compared byte for byte "
                        "(a pickled object: as one stream)")


def _compare_bytes(reader_a: TensorReader, reader_b: TensorReader, entry: "TensorDiff", old: str, new: str,
                   report: "DiffReport") -> None:
    """Data that is not numbers is equal when its stored bytes are: compare them, element by
    element where elements have a fixed size (a pickle is one stream: equal or not)."""
    chunks_a, chunks_b = reader_a.stored_bytes(old), reader_b.stored_bytes(new)
    if chunks_a is None or chunks_b is None:
        return
    info = reader_a.tensors[old]
    itemsize = 0 if info.dtype.hasobject else info.dtype.itemsize
    differing, total_a, total_b = _stream_difference(chunks_a, chunks_b, itemsize)
    report.bytes_read += total_a + total_b
    entry.status = Status.COMPARED
    entry.elements = math.prod(entry.shape_a or [])
    entry.outside = differing if itemsize else min(differing, 1)
    entry.note = Remark(RemarkKind.BYTES, "not numbers: compared byte for byte"
                        + ("" if itemsize else " (pickled objects: as one stream)"))


def _compare_pairs(reader_a: TensorReader, reader_b: TensorReader, pairs: list[tuple[TensorDiff, str, str]],
                   report: DiffReport, budget: Budget) -> None:
    rtol, atol = report.rtol, report.atol
    accumulators = {entry.name: DiffSums() for entry, _, _ in pairs}
    walks = [pair_walk(entry.name, reader_a, old, reader_b, new) for entry, old, new in pairs]

    def compare(block: Block, scratch: Scratch) -> list[tuple]:
        a, b = block.data
        same_bytes = a.dtype == b.dtype and a.nbytes == b.nbytes and np.array_equal(
            a.view(np.uint8), b.view(np.uint8))
        buffer = scratch.work
        results = []
        for _, (x, y) in block.units():
            if same_bytes and not is_complex(x.dtype):
                results.append(identical_unit(x, buffer))
            else:
                results.append(compare_unit(x, y, rtol, atol, buffer))
        return results

    def merge(block: Block, results: list[tuple]) -> None:
        accumulator = accumulators[block.walk.name]
        for result in results:
            accumulator.add(result)

    report.bytes_read += run_pass(walks, budget, compare, merge)
    for entry, _, _ in pairs:
        acc = accumulators[entry.name]
        entry.elements = math.prod(entry.shape_a or [])
        dd, aa, bb, ab = acc.dd.value, acc.aa.value, acc.bb.value, acc.ab.value
        entry.diff_norm = math.sqrt(dd) if dd >= 0 else math.nan
        entry.norm_a, entry.norm_b = math.sqrt(aa), math.sqrt(bb)
        entry.max_abs_diff = acc.largest
        entry.outside, entry.nonfinite_mismatch = acc.outside, acc.nonfinite
        if entry.norm_a == 0:
            entry.relative = 0.0 if entry.diff_norm == 0 else math.inf
        else:
            entry.relative = entry.diff_norm / entry.norm_a
        if entry.norm_a == 0 and entry.norm_b == 0:
            entry.cosine = 1.0
        elif entry.norm_a == 0 or entry.norm_b == 0:
            entry.cosine = 0.0
        else:
            entry.cosine = max(-1.0, min(1.0, ab / (entry.norm_a * entry.norm_b)))
        if entry.dtype_a != entry.dtype_b or entry.label_a != entry.label_b:
            entry.note = Remark(RemarkKind.DTYPES_DIFFER, f"dtypes differ ({dtype_text(entry.dtype_a, entry.label_a)} "
                                                          f"vs {dtype_text(entry.dtype_b, entry.label_b)}): compared "
                                                          "as values")

