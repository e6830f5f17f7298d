"""Report data: what tclip found and did, as plain dataclasses, and its JSON form.

Rendering for people lives in :mod:`tclip.cli.render`; this module knows nothing of
terminals. JSON is strictly valid: non-finite floats become "nan", "inf", "-inf".
Dtypes stay ``np.dtype`` here and become names only in JSON and tables; skip
reasons and warnings are :class:`~tclip.messages.Tagged` texts whose kind code reads.
"""

from __future__ import annotations

import enum
import math
from dataclasses import asdict, dataclass, field, fields
from typing import Any, overload

import numpy as np

from ..core.dtypes import dtype_name
from ..messages import Naming, Tagged, library_name, spelled
from .selection import Skip, SkipKind

_NOT_SELECTED = SkipKind.NOT_SELECTED
# Selected tensors a check could not measure: the format refused them, their type is unreadable,
# or they are quantized weights tclip does not understand.
UNMEASURED = (SkipKind.REFUSED, SkipKind.UNREADABLE_TYPE, SkipKind.NOT_UNDERSTOOD)

SCHEMA_VERSION = 1
# A slice whose L2 norm is at most this is counted as near zero (a dead row).
NEAR_ZERO_NORM = 1e-12
# How many of the largest slices a report names.
WORST_SLICES = 5


class NoteKind(enum.Enum):
    """What a report's warning is about."""

    UNMATCHED_PATTERN = "a selection pattern matches no tensor"
    AXES_SKIPPED = "tensors whose rank cannot take the axes were left unchanged"
    NOTHING_SELECTED = "no floating-point tensor was selected"
    HARD_LINKS = "the input has other hard links"
    DROPPED = "a conversion dropped what the output format cannot hold"
    ZERO_SCALES = "a quantized weight has zero scales (dead blocks)"
    NONFINITE_SCALES = "a quantized weight has NaN/Inf scales"
    RESUMED = "an unfinished in-place run was resumed"
    INTERRUPTED = "an in-place run was interrupted here"
    CHECK_FAILED = "a check the user asked for failed"
    FLUSHED_TO_ZERO = "scaling made non-zero values of narrow floats zero"
    LOSSY = "tensors were written through a lossy filter"
    OPTIMIZER_STATE = "a training optimizer's state was left out"
    INDEX_CHOSEN = "a folder holds two indexes of one checkpoint; one was taken"
    NO_OUTPUT = "a dry run found no output a real run could write"
    TASK_REPEATED = "a file's task ran twice and found the file rewritten already"
    DATA_MISSING = "the file's header lists data the file does not hold (it is truncated)"
    NO_TENSORS = "a file of a folder or a glob holds no tensors tclip reads; it was left out"
    FOLDER_WEIGHTS = "a folder's model weights were taken, its other tensor files left"


class Note(Tagged):
    """A warning of a report: its text (options named by the library; the command line
    spells them as flags) and its :class:`NoteKind`."""

    kind: NoteKind


@overload
def dtype_text(dtype: np.dtype | str, label: str | None = None) -> str: ...
@overload
def dtype_text(dtype: np.dtype | str | None, label: str | None = None) -> str | None: ...
def dtype_text(dtype: np.dtype | str | None, label: str | None = None) -> str | None:
    """A dtype as reports show it: the label of data that is not numbers, else its name."""
    if label is not None:
        return label
    if dtype is None or isinstance(dtype, str):
        return dtype
    return dtype_name(dtype)


@dataclass
class TensorReport:
    """One tensor's line of the report.

    ``norm`` is the L2 norm of the whole tensor (``report --ord`` picks another
    order); with axes, ``max_slice_norm`` is the largest slice norm and
    ``slices_clipped`` counts the slices that were scaled. ``scale`` is the factor
    applied (the smallest one, per slice). ``changed`` counts elements that value
    clipping changed. ``skipped`` says why a tensor was left as it is (in the
    report, a tensor whose rank cannot take the axes is still measured whole).
    """

    name: str
    shape: list[int]
    dtype: np.dtype
    nbytes: int
    norm: float | None = None
    norm_after: float | None = None
    scale: float | None = None
    clipped: bool = False
    skipped: Skip | None = None
    nan: int = 0
    inf: int = 0
    max_abs: float | None = None
    slices: int | None = None
    slices_clipped: int | None = None
    max_slice_norm: float | None = None
    max_slice_norm_after: float | None = None
    changed: int | None = None
    min: float | None = None
    max: float | None = None
    mean: float | None = None
    std: float | None = None
    zeros: int | None = None
    histogram: tuple[int, list[int]] | None = None
    min_slice_norm: float | None = None
    near_zero_slices: int | None = None
    slices_above: int | None = None  # a report with a gate's limit: slices above it
    worst_slices: list[dict[str, Any]] | None = None
    dtype_label: str | None = None  # shown instead of the dtype (data that is not numbers, a quantized weight)
    # A rewritten 16- or 8-bit float tensor: non-zero values the scaling made zero (None: not counted).
    flushed_to_zero: int | None = None
    quantization: dict[str, Any] | None = None  # a quantized weight: scheme, parts, what its scales held
    nonfinite_where: str | None = None  # a quantized weight: where its NaN/Inf are (codes or scales, which block)
    # Views of one storage (a PyTorch file): the global norm counts each stored element once.
    tied_to: str | None = None  # an earlier tensor holding exactly its stored elements (tied weights, a transpose)
    part_of: str | None = None  # a tensor holding all its stored elements and more (a row of a weight)
    # where it overlaps other views otherwise: the norm (of the report's order) of the stored
    # elements it holds first, its part of the global norm; after the rewrite too (None: not measured)
    counted_norm: float | None = None
    counted_norm_after: float | None = None

    @property
    def dtype_text(self) -> str:
        return dtype_text(self.dtype, self.dtype_label)

    @property
    def nonfinite(self) -> int:
        return self.nan + self.inf

    def counted(self, after: bool = False) -> float | None:
        """Its part of the global norm (before, or after the rewrite): each stored element once."""
        if self.tied_to is not None or self.part_of is not None:
            return 0.0
        if self.counted_norm is not None:
            return self.counted_norm_after if after else self.counted_norm
        return self.norm_after if after else self.norm

    @property
    def selected(self) -> bool:
        """Whether the selection (--include/--exclude) picked it; an unselected tensor is
        not *skipped*: skipped means it was picked and could not be worked on."""
        return self.skipped is None or self.skipped.kind is not _NOT_SELECTED

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    def to_json(self) -> dict[str, Any]:
        item = {name: getattr(self, name) for name in _TENSOR_FIELDS}
        item["dtype"] = self.dtype_text
        del item["dtype_label"]
        item["shape"] = list(self.shape)
        item["nonfinite"] = {"nan": self.nan, "inf": self.inf}
        item["selected"] = self.selected
        if not self.selected:
            item["skipped"] = None
        del item["nan"], item["inf"]
        histogram = item.pop("histogram")
        if histogram is not None:
            item["log2_histogram"] = {"lowest": histogram[0], "counts": histogram[1]}
        del item["nonfinite_where"]
        for key in ("min", "max", "mean", "std", "zeros", "min_slice_norm", "near_zero_slices", "slices_above",
                    "worst_slices", "quantization", "tied_to", "part_of", "counted_norm", "counted_norm_after"):
            if item[key] is None:
                del item[key]
        if self.zeros is not None and self.numel:
            item["zero_fraction"] = self.zeros / self.numel
        return item


_TENSOR_FIELDS = [f.name for f in fields(TensorReport)]


@dataclass
class OtherReport:
    """Something in a file that is not a tensor (an HDF5 string dataset, a dimension scale)."""

    name: str
    kind: str
    reason: str
    shape: list[int] | None = None
    dtype: str = ""
    unreadable_type: bool = False  # of a type tclip cannot read that may hold numbers: no check passes over it
    # selected and of a type tclip cannot read: a skipped tensor, never measured (counted as skipped)
    not_measured: bool = False

    @classmethod
    def of(cls, other: Any, selected: bool = False) -> "OtherReport":
        """The report line of a format's :class:`~tclip.formats.OtherObject` (``selected``: the
        selection takes it, so one of an unreadable type is a tensor not measured)."""
        return cls(other.name, other.kind, other.reason, None if other.shape is None else list(other.shape),
                   other.dtype, other.unreadable_type, selected and other.unreadable_type)


def slice_label(shape: list[int], axes: tuple[int, ...] | None) -> str:
    """'row' for the slices of a 2-D tensor along axis 1, 'column' along axis 0, else 'slice'."""
    if len(shape) == 2 and axes == (1,):
        return "row"
    if len(shape) == 2 and axes == (0,):
        return "column"
    return "slice"


@dataclass
class FileReport:
    """Everything tclip reports about one input file."""

    file: str
    mode: str
    params: dict[str, Any] = field(default_factory=dict)
    format: str | None = None
    output: str | None = None
    tensors: list[TensorReport] = field(default_factory=list)
    global_norm: float | None = None
    global_norm_after: float | None = None
    ord: str = "2"
    bytes_read: int = 0
    bytes_written: int = 0
    elapsed_s: float = 0.0
    dry_run: bool = False
    error: str | None = None
    warnings: list[Note] = field(default_factory=list)
    metadata: dict[str, Any] = field(default_factory=dict)
    others: list[OtherReport] = field(default_factory=list)
    would_write: str | None = None  # dry run: the output a real run would write (a set: its index)
    members: list[dict[str, Any]] | None = None  # a tensor set: its files and their outputs
    output_exists: bool | None = None
    # dry run: how a real run would write (in place needs no --force; else --force
    # replaces outputs that exist) and, for a set, each file's output
    in_place: bool = False
    overwrite: bool = False
    would_write_files: list[dict[str, Any]] | None = None
    # a set written to an output folder: the checkpoint folder's other files copied
    # (config.json, tokenizer files...), and those left out, with why
    copied: list[str] | None = None
    not_copied: list[dict[str, str]] | None = None
    would_copy: list[dict[str, Any]] | None = None
    # report --max-norm: the gate's decision (a tclip.work.gate.GateResult: verdict and typed reasons)
    gate: Any = None

    @property
    def outputs_existing(self) -> int:
        """Dry run: how many of the outputs a real run would write exist already."""
        files = sum(bool(f["exists"]) for f in [*(self.would_write_files or []), *(self.would_copy or [])])
        return files + bool(self.would_write is not None and self.output_exists)

    @property
    def clipped_count(self) -> int:
        return sum(t.clipped for t in self.tensors)

    @property
    def skipped_count(self) -> int:
        """Selected tensors left as they are (not floating, rank, refused, of a type tclip cannot
        read...); unselected ones are counted apart (:attr:`not_selected_count`)."""
        return sum(t.skipped is not None and t.selected for t in self.tensors) + \
            sum(o.not_measured for o in self.others)

    @property
    def not_measured_count(self) -> int:
        """Selected tensors tclip could not measure (refused by their format, of a type it cannot
        read, quantized in a way it does not understand): the global norm leaves them out."""
        return sum(t.selected and t.skipped is not None and t.skipped.kind in UNMEASURED for t in self.tensors) + \
            sum(o.not_measured for o in self.others)

    @property
    def measured_count(self) -> int:
        """Selected tensors worked on: those the global norm covers."""
        return sum(t.selected and t.skipped is None for t in self.tensors)

    @property
    def not_selected_count(self) -> int:
        return sum(not t.selected for t in self.tensors)

    @property
    def nonfinite_tensors(self) -> list[str]:
        return [t.name for t in self.tensors if t.nonfinite]

    def to_json(self, name: Naming = library_name) -> dict[str, Any]:
        """The JSON Lines object for this file (schema documented in README); ``name``
        names the options that warnings mention."""
        data = {
            "schema": SCHEMA_VERSION,
            "file": self.file,
            "format": self.format,
            "output": self.output,
            "mode": self.mode,
            "params": self.params,
            "dry_run": self.dry_run,
            "ord": self.ord,
            "global_norm": self.global_norm,
            "global_norm_after": self.global_norm_after,
            "tensors_clipped": self.clipped_count,
            "tensors_skipped": self.skipped_count,
            "tensors_not_measured": self.not_measured_count,
            "tensors_not_selected": self.not_selected_count,
            "tensors": [t.to_json() for t in self.tensors],
            "bytes_read": self.bytes_read,
            "bytes_written": self.bytes_written,
            "elapsed_s": round(self.elapsed_s, 6),
            "warnings": [spelled(w, name) for w in self.warnings],
            "error": self.error,
        }
        if self.others:
            data["not_tensors"] = [asdict(o) for o in self.others]
        if self.members is not None:
            data["files"] = self.members
        if self.metadata:
            data["metadata"] = self.metadata
        if self.dry_run and (self.would_write is not None or self.would_write_files is not None):
            would_write: dict[str, object] = {"output": self.would_write, "exists": self.output_exists,
                                              "in_place": self.in_place}
            if self.would_write_files is not None:
                would_write["files"] = self.would_write_files
            if self.would_copy:
                would_write["copies"] = self.would_copy
            data["would_write"] = would_write
        if self.copied is not None:
            data["copied"] = self.copied
        if self.not_copied:
            data["not_copied"] = self.not_copied
        if self.gate is not None:
            data.update(self.gate.to_json())
        return json_safe(data)


def json_safe(value: Any) -> Any:
    """Plain JSON values: non-finite floats as "nan"/"inf"/"-inf", bytes decoded, recursively."""
    if isinstance(value, float):
        if math.isnan(value):
            return "nan"
        if math.isinf(value):
            return "inf" if value > 0 else "-inf"
        return value
    if isinstance(value, dict):
        return {str(k): json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    if isinstance(value, (bytes, bytearray)):
        try:
            return bytes(value).decode("utf-8")
        except UnicodeDecodeError:
            return bytes(value).decode("latin-1")
    if isinstance(value, (str, int, bool)) or value is None:
        return value
    if hasattr(value, "item") and not isinstance(value, str):  # NumPy scalars
        try:
            return json_safe(value.item())
        except (TypeError, ValueError):
            return str(value)
    return str(value)


@dataclass
class InfoTensor:
    """One tensor of ``info``; a quantized weight has its ``encoding`` (scheme and parts), an
    activation scale its ``role``."""

    name: str
    shape: list[int]
    dtype: np.dtype
    nbytes: int
    attrs: dict[str, Any] = field(default_factory=dict)
    refused: str | None = None
    dtype_label: str | None = None
    encoding: Any = None
    role: str | None = None
    file: str | None = None  # a set's tensor: the shard holding it (as its index names it)
    tied_to: str | None = None  # as in TensorReport: an earlier tensor holding exactly its stored elements
    part_of: str | None = None  # a tensor holding all its stored elements and more
    stored: int | None = None  # where it overlaps other views otherwise: the stored elements it holds first
    chunk_files: list[str] | None = None  # a DCP tensor: the .distcp files holding its chunks, in chunk order

    @property
    def dtype_text(self) -> str:
        return dtype_text(self.dtype, self.dtype_label)

    @property
    def counted_params(self) -> int:
        """Its part of the file's parameter count: each stored element once."""
        if self.tied_to is not None or self.part_of is not None:
            return 0
        return self.stored if self.stored is not None else math.prod(self.shape)


@dataclass
class InfoReport:
    """The header of a file: tensors and metadata, no data read."""

    file: str
    format: str
    size_bytes: int
    tensors: list[InfoTensor]
    metadata: dict[str, Any]
    others: list[OtherReport] = field(default_factory=list)
    shared: list[list[str]] = field(default_factory=list)  # tensors stored in one buffer (tied weights)
    files: list[str] | None = None  # a set: its shards, in natural order (as its index names them)
    warnings: list[Note] = field(default_factory=list)  # e.g. the data is missing (a file cut after its header)
    storage_files: dict[str, int] | None = None  # a DCP folder: every .distcp file (in natural order), its bytes

    def dtype_texts(self) -> list[str]:
        """Each tensor's dtype as shown (one name per distinct dtype: a header can list a million tensors)."""
        names: dict[tuple[np.dtype, str | None], str] = {}
        out = []
        for t in self.tensors:
            key = (t.dtype, t.dtype_label)
            text = names.get(key)
            if text is None:
                text = names[key] = t.dtype_text
            out.append(text)
        return out

    def params_by_dtype(self) -> dict[str, int]:
        counts: dict[str, int] = {}
        for t, text in zip(self.tensors, self.dtype_texts()):
            counts[text] = counts.get(text, 0) + t.counted_params
        return counts

    def to_json(self, name: Naming = library_name) -> dict[str, Any]:
        # Built by hand, not with asdict/json_safe: a header can list a million tensors.
        tensors = []
        for t, text in zip(self.tensors, self.dtype_texts()):
            item = {"name": t.name, "shape": list(t.shape), "dtype": text, "nbytes": t.nbytes,
                    "attrs": json_safe(t.attrs) if t.attrs else {}}
            if t.refused is not None:
                item["refused"] = t.refused
            if t.encoding is not None:
                item["quantization"] = {"scheme": t.encoding.scheme, "convention": t.encoding.convention,
                                        "parts": [{"name": n, "role": r, "dtype": d, "shape": list(s)}
                                                  for n, r, d, s in t.encoding.parts]}
                if t.encoding.problem is not None:
                    item["quantization"]["problem"] = t.encoding.problem
            if t.role is not None:
                item["role"] = t.role
            if t.file is not None:
                item["file"] = t.file
            if t.tied_to is not None:
                item["tied_to"] = t.tied_to
            if t.part_of is not None:
                item["part_of"] = t.part_of
            if t.stored is not None:
                item["stored_params"] = t.stored
            if t.chunk_files is not None:
                item["chunk_files"] = t.chunk_files
            tensors.append(item)
        data: dict[str, Any] = {
            "schema": SCHEMA_VERSION,
            "file": self.file,
            "format": self.format,
            "size_bytes": self.size_bytes,
            "tensors": tensors,
            "params": sum(t.counted_params for t in self.tensors),
            "params_by_dtype": self.params_by_dtype(),
            "metadata": json_safe(self.metadata),
        }
        if self.others:
            data["not_tensors"] = json_safe([asdict(o) for o in self.others])
        if self.shared:
            data["shared_storage"] = [list(names) for names in self.shared]
        if self.files is not None:
            data["files"] = list(self.files)
        if self.storage_files is not None:
            data["storage_files"] = [{"file": f, "bytes": n} for f, n in self.storage_files.items()]
        if self.warnings:
            data["warnings"] = [spelled(w, name) for w in self.warnings]
        return data
