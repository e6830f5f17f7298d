"""Report data: what tclip found and did, as plain dataclasses, and its JSON form.

Rendering for people lives in :mod:`tclip.render`; this module knows nothing of
terminals. JSON is strictly valid: non-finite floats become "nan", "inf", "-inf".
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

SCHEMA_VERSION = 1


@dataclass
class TensorReport:
    """One tensor's line of the report.

    ``norm`` is the L2 norm of the whole tensor (``report --ord`` picks another
    order); with axes, ``max_slice_norm`` is the largest slice norm and
    ``slices_clipped`` counts the slices that were scaled. ``scale`` is the factor
    applied (the smallest one, per slice). ``changed`` counts elements that value
    clipping changed. ``skipped`` says why a tensor was left as it is.
    """

    name: str
    shape: list[int]
    dtype: str
    nbytes: int
    norm: float | None = None
    norm_after: float | None = None
    scale: float | None = None
    clipped: bool = False
    skipped: str | None = None
    nan: int = 0
    inf: int = 0
    max_abs: float | None = None
    slices: int | None = None
    slices_clipped: int | None = None
    max_slice_norm: float | None = None
    max_slice_norm_after: float | None = None
    changed: int | None = None

    @property
    def nonfinite(self) -> int:
        return self.nan + self.inf

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


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
    warnings: list[str] = field(default_factory=list)
    metadata: dict[str, Any] = field(default_factory=dict)

    @property
    def clipped_count(self) -> int:
        return sum(t.clipped for t in self.tensors)

    @property
    def skipped_count(self) -> int:
        return sum(t.skipped is not None for t in self.tensors)

    @property
    def nonfinite_tensors(self) -> list[str]:
        return [t.name for t in self.tensors if t.nonfinite]

    def to_json(self) -> dict[str, Any]:
        """The JSON Lines object for this file (schema documented in README)."""
        tensors = []
        for t in self.tensors:
            item = asdict(t)
            item["nonfinite"] = {"nan": t.nan, "inf": t.inf}
            del item["nan"], item["inf"]
            tensors.append(item)
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
            "tensors": tensors,
            "bytes_read": self.bytes_read,
            "bytes_written": self.bytes_written,
            "elapsed_s": round(self.elapsed_s, 6),
            "warnings": self.warnings,
            "error": self.error,
        }
        if self.metadata:
            data["metadata"] = self.metadata
        return json_safe(data)


def json_safe(value: Any) -> Any:
    """Replace non-finite floats by the strings "nan", "inf", "-inf", recursively."""
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
    if hasattr(value, "item") and not isinstance(value, (str, bytes)):  # NumPy scalars
        return json_safe(value.item())
    return value


@dataclass
class InfoTensor:
    name: str
    shape: list[int]
    dtype: str
    nbytes: int
    attrs: dict[str, Any] = field(default_factory=dict)


@dataclass
class InfoReport:
    """The header of a file: tensors and metadata, no data read."""

    file: str
    format: str
    size_bytes: int
    tensors: list[InfoTensor]
    metadata: dict[str, Any]

    def params_by_dtype(self) -> dict[str, int]:
        counts: dict[str, int] = {}
        for t in self.tensors:
            counts[t.dtype] = counts.get(t.dtype, 0) + math.prod(t.shape)
        return counts

    def to_json(self) -> dict[str, Any]:
        return json_safe({
            "schema": SCHEMA_VERSION,
            "file": self.file,
            "format": self.format,
            "size_bytes": self.size_bytes,
            "tensors": [asdict(t) for t in self.tensors],
            "params": sum(math.prod(t.shape) for t in self.tensors),
            "params_by_dtype": self.params_by_dtype(),
            "metadata": self.metadata,
        })
