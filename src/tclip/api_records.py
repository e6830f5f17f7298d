"""The records the Python API (:mod:`tclip.api`) returns: plain, typed, JSON-able data.

Each result keeps the work layer's report it was made from as ``raw`` (its ``to_json()``
is the command line's ``--json`` object); the fields here are the ones a batch script
reads. pandas is optional: ``to_pandas()`` imports it when called.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from .work.results import json_safe

PANDAS_MISSING = "to_pandas() needs pandas, which is not installed (pip install pandas); to_records() needs nothing"


def _pandas() -> Any:
    try:
        import pandas  # type: ignore[import-untyped,unused-ignore]
    except ImportError as error:
        raise ImportError(PANDAS_MISSING) from error
    return pandas


@dataclass(frozen=True)
class TensorInfo:
    """What ``Checkpoint.info(name)`` says of one tensor, from the header alone.

    ``dtype`` is the dtype ``ck[name]`` returns (float32 for a quantized weight);
    ``stored_dtype`` names what the file stores (``"Q4_0"``, ``"fp8 block"``...) where
    that differs; ``nbytes`` is what the file stores for it.
    """

    name: str
    shape: tuple[int, ...]
    dtype: str
    nbytes: int
    quantized: bool = False
    stored_dtype: str | None = None

    def to_json(self) -> dict[str, Any]:
        item = asdict(self)
        item["shape"] = list(self.shape)
        return item


@dataclass(frozen=True)
class TensorRecord:
    """One tensor of a report or a clip.

    ``norm`` is of the report's order (None: not measured, ``skipped`` says why);
    ``nonfinite`` is ``nan + inf``.
    """

    name: str
    shape: tuple[int, ...]
    dtype: str
    norm: float | None
    nonfinite: int
    nan: int
    inf: int
    max_abs: float | None
    skipped: str | None
    clipped: bool = False
    scale: float | None = None
    norm_after: float | None = None
    slices: int | None = None
    slices_above: int | None = None
    max_slice_norm: float | None = None
    mean: float | None = None
    std: float | None = None
    min: float | None = None
    max: float | None = None
    zeros: int | None = None

    @classmethod
    def of(cls, t: Any) -> "TensorRecord":
        return cls(t.name, tuple(int(n) for n in t.shape), t.dtype_text, t.norm, t.nan + t.inf, t.nan, t.inf,
                   t.max_abs, None if t.skipped is None else str(t.skipped), t.clipped, t.scale, t.norm_after,
                   t.slices, t.slices_above, t.max_slice_norm, t.mean, t.std, t.min, t.max, t.zeros)

    def to_record(self) -> dict[str, Any]:
        """A dict of the fields (NaN stays a float NaN)."""
        item = asdict(self)
        item["shape"] = list(self.shape)
        return item

    def to_json(self) -> dict[str, Any]:
        return json_safe(self.to_record())


def _records(tensors: list[TensorRecord]) -> list[dict[str, Any]]:
    return [t.to_record() for t in tensors]


@dataclass
class Report:
    """The result of :func:`tclip.report`.

    ``passed`` is the gate's verdict (what makes ``tclip report --max-norm`` exit 3 when
    False): None when no ``max_norm`` was given, since nothing was checked then (the
    command line exits 0). ``verdict`` is ``"passed"``, ``"failed"``, ``"incomplete"``
    or None; ``reasons`` the gate's reasons, one line each.
    """

    file: str
    format: str | None
    ord: str
    global_norm: float | None
    tensors: list[TensorRecord]
    passed: bool | None = None
    verdict: str | None = None
    reasons: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    raw: Any = field(default=None, repr=False, compare=False)

    @classmethod
    def of(cls, report: Any) -> "Report":
        gate = report.gate
        return cls(report.file, report.format, report.ord, report.global_norm,
                   [TensorRecord.of(t) for t in report.tensors],
                   None if gate is None else gate.passed, None if gate is None else gate.verdict.value,
                   [] if gate is None else gate.lines(), [str(w) for w in report.warnings], report)

    def to_records(self) -> list[dict[str, Any]]:
        """One dict per tensor (the fields of :class:`TensorRecord`)."""
        return _records(self.tensors)

    def to_pandas(self) -> Any:
        """A DataFrame, one row per tensor (needs pandas)."""
        return _pandas().DataFrame(self.to_records())

    def to_json(self) -> dict[str, Any]:
        """The command line's ``--json`` object for this report (with ``verdict`` under a gate)."""
        return self.raw.to_json()


@dataclass
class Summary:
    """The result of :func:`tclip.summary`: one report per file (or set), in step order."""

    of: str
    reports: list[Report]

    def to_records(self) -> list[dict[str, Any]]:
        """One dict per file: ``file``, ``global_norm``, then each tensor's norm under its name."""
        rows = []
        for report in self.reports:
            row: dict[str, Any] = {"file": report.file, "global_norm": report.global_norm}
            row.update({t.name: t.norm for t in report.tensors})
            rows.append(row)
        return rows

    def to_pandas(self) -> Any:
        """A DataFrame indexed by file, a column per tensor (needs pandas)."""
        return _pandas().DataFrame(self.to_records()).set_index("file")

    def to_json(self) -> dict[str, Any]:
        return {"of": self.of, "files": json_safe(self.to_records())}


@dataclass
class HistorySummary:
    """The result of ``tclip.summary(..., of="grads"|"drift")``: one entry per checkpoint (a
    file, or a Trainer ``checkpoint-N/`` folder), in step order.

    ``items`` are the command line's ``--json`` objects (``to_json()``), one per checkpoint;
    ``raw`` is the work layer's grid (tensors x checkpoints).
    """

    of: str
    items: list[dict[str, Any]]
    raw: Any = field(default=None, repr=False, compare=False)

    @property
    def files(self) -> list[str]:
        return [item["file"] for item in self.items]

    @property
    def tensors(self) -> list[str]:
        """The tensor names (the grid's rows), natural order."""
        return list(self.raw.rows)

    def to_records(self, ema: bool = False) -> list[dict[str, Any]]:
        """One dict per checkpoint: ``file``, ``label``, then each tensor's value under its name:
        for grads the interval gradient norm since the previous checkpoint (with ``ema=True``,
        the bias-corrected EMA norm instead), for drift the drift (None in the first). A tensor
        with no value in a checkpoint is None there."""
        if ema and self.of != "grads":
            raise ValueError("ema=True: only a grads summary has EMA norms")
        rows = []
        for c, item in enumerate(self.items):
            row: dict[str, Any] = {"file": item["file"], "label": item["label"]}
            if ema:
                by_name = {d["name"]: d["ema_norm"] for d in self.raw.extra.get(item["file"], [])}
                row.update({name: by_name.get(name) for name in self.raw.rows})
            else:
                row.update({name: self.raw.values[r][c] for r, name in enumerate(self.raw.rows)})
            rows.append(row)
        return rows

    def to_pandas(self, ema: bool = False) -> Any:
        """A DataFrame indexed by file, a column per tensor (needs pandas)."""
        return _pandas().DataFrame(self.to_records(ema)).set_index("file")

    def to_json(self) -> list[dict[str, Any]]:
        """The command line's ``--json`` objects, one per checkpoint."""
        return self.items


@dataclass
class ClipResult:
    """The result of :func:`tclip.clip`: ``clipped`` names the tensors it scaled;
    ``output`` is the file (or index) written, None on a dry run."""

    file: str
    output: str | None
    would_write: str | None
    dry_run: bool
    global_norm: float | None
    global_norm_after: float | None
    clipped: list[str]
    tensors: list[TensorRecord]
    warnings: list[str] = field(default_factory=list)
    raw: Any = field(default=None, repr=False, compare=False)

    @classmethod
    def of(cls, report: Any) -> "ClipResult":
        return cls(report.file, report.output, report.would_write, report.dry_run, report.global_norm,
                   report.global_norm_after, [t.name for t in report.tensors if t.clipped],
                   [TensorRecord.of(t) for t in report.tensors], [str(w) for w in report.warnings], report)

    def to_records(self) -> list[dict[str, Any]]:
        return _records(self.tensors)

    def to_pandas(self) -> Any:
        return _pandas().DataFrame(self.to_records())

    def to_json(self) -> dict[str, Any]:
        return self.raw.to_json()


@dataclass(frozen=True)
class DiffRecord:
    """One tensor of a comparison: ``status`` is ``"same"``, ``"differ"``... as in ``--json``."""

    name: str
    status: str
    differs: bool
    diff_norm: float | None
    relative: float | None
    max_abs_diff: float | None
    outside: int
    name_b: str | None = None

    @classmethod
    def of(cls, t: Any) -> "DiffRecord":
        return cls(t.name, t.status.value, t.differs, t.diff_norm, t.relative, t.max_abs_diff, t.outside, t.name_b)

    def to_record(self) -> dict[str, Any]:
        return asdict(self)

    def to_json(self) -> dict[str, Any]:
        return json_safe(asdict(self))


@dataclass
class DiffResult:
    """The result of :func:`tclip.diff`: ``verdict`` is ``"same"`` (what exits 0), ``"differ"``
    or ``"incomplete"`` (nothing differs but something could not be compared)."""

    a: str
    b: str
    verdict: str
    differs: bool
    tensors: list[DiffRecord]
    warnings: list[str] = field(default_factory=list)
    raw: Any = field(default=None, repr=False, compare=False)

    @property
    def same(self) -> bool:
        return self.verdict == "same"

    def to_records(self) -> list[dict[str, Any]]:
        return [t.to_record() for t in self.tensors]

    def to_pandas(self) -> Any:
        return _pandas().DataFrame(self.to_records())

    def to_json(self) -> dict[str, Any]:
        return self.raw.to_json()

    @classmethod
    def of(cls, report: Any) -> "DiffResult":
        return cls(report.a, report.b, report.verdict.value, report.differs,
                   [DiffRecord.of(t) for t in report.tensors], [str(w) for w in report.warnings], report)
