"""GGUF files (llama.cpp, ollama, LM Studio) as a format module.

The header is parsed by :mod:`~tclip.formats.gguf.header` (every count and length checked
against the file, long arrays summarised); the blocks' arithmetic is
:mod:`tclip.quant.ggml.blocks`. What the reader lists:

- F32, F16, BF16, F64 and the integer types as plain tensors (NumPy-order shape, the
  file's byte order): measured and clipped like the tensors of every other format;
- Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K as one stored tensor of
  blocks each, under its GGUF name, with an :class:`GgmlBlocks` encoding: statistics of
  ggml's float32 values in closed form (``block_stats``), the NaN/Inf scan of every
  block's ``d``/``dmin``/``m`` (``scan_scales``' fields), rescaled by rewriting those
  f16 fields only (``scale_blocks``: codes keep their bytes);
- the other types ggml defines (IQ*, TQ*, Q8_K, MXFP4, ...) as quantized but not
  understood: listed, never measured, refused for clipping;
- a type ggml does not define as an :class:`~tclip.formats.base.OtherObject` of an
  unreadable type (its size is unknown: its bytes are carried as they are).

A GGUF output is always a rewrite of its input: the file is copied byte for byte
(header, metadata, padding, untouched tensors) and only the data of the rewritten
tensors is written anew, at the same offsets. Nothing is converted to or from GGUF.
"""

from __future__ import annotations

import functools
import math
import os
from collections.abc import Callable, Collection
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from ...core.kernels import UnitMoments, reduce_unit
from ...errors import FormatError, TclipError, UnsupportedError
from ...messages import Option
from ...quant.codes import Findings, ScaleFindings
from .._io import copy_except, flat_result, pread_into
from ..atomic import AtomicOutput
from ..base import (
    Encoding,
    EncodingSummary,
    OtherObject,
    PositionalWriter,
    TensorInfo,
    TensorReader,
    TensorWriter,
    read_region,
)

if TYPE_CHECKING:
    from .header import GgufHeader, GgufTensor


def _blocks() -> Any:
    """tclip.quant.ggml.blocks, imported on first use: with the header parser it costs some
    8 ms, which a command that meets no GGUF file need not pay."""
    from ...quant.ggml import blocks

    return blocks

NAME = "gguf"
SUFFIXES = (".gguf",)
HOLDS_METADATA = True

# Plain types: the stored elements are the values (F16/F32/F64 in the file's byte order).
_PLAIN = {0: "f4", 1: "f2", 28: "f8", 24: "i1", 25: "i2", 26: "i4", 27: "i8"}
BF16 = 30


@functools.cache
def quantized_types() -> frozenset[int]:
    """Quantized types whose values tclip computes and whose scales it rewrites."""
    blocks = _blocks()
    return frozenset(t for t in blocks.GGML_TYPES if blocks.is_supported(t) and blocks.can_scale(t))


# Bytes of blocks read at once by a rescale or a value source.
_BAND_BYTES = 8 << 20
# How far a rescaled tensor's norm (or row's, with one factor per row) may land from the
# factor times the old one, relative: the max_norm gate's tolerance for float16, so a clipped
# tensor passes it. Rounding normal f16 scales moves a block by at most 2**-11 and a tensor's
# norm by far less; only scales pushed deep among the subnormals move it more.
MAX_SCALE_ROUNDING = 2.0 ** -9


def sniff(head: bytes, size: int) -> bool:
    """GGUF's magic (the same four bytes in little- and big-endian files)."""
    return head.startswith(b"GGUF")  # header.GGUF_MAGIC


def _bfloat16() -> np.dtype:
    import ml_dtypes

    return np.dtype(ml_dtypes.bfloat16)


# --------------------------------------------------------------------------- metadata


def _metadata_value(value: Any, kind: Any) -> Any:
    """A metadata value as plain data (long arrays and strings summarised, never whole)."""
    from .header import GgufArray, GgufLongString

    if isinstance(value, GgufArray):
        return {"array": value.element_type.name, "length": value.length,
                "first": [_metadata_value(v, value.element_type) for v in value.head]}
    if isinstance(value, GgufLongString):
        return {"string_bytes": value.nbytes, "first": value.head}
    return value


# --------------------------------------------------------------------------- quantized blocks


def _row_factors(factor: np.ndarray, rows: int) -> np.ndarray | None:
    """One factor per row (float64), or None for one factor for the whole tensor."""
    factor = np.asarray(factor, np.float64)
    if factor.ndim == 0 or factor.size == 1:
        return None
    if factor.size != rows:
        raise ValueError(f"{factor.size} factors for {rows} rows")
    return factor.reshape(-1)


def _row_text(row: int, shape: tuple[int, ...]) -> str:
    where = np.unravel_index(row, shape[:-1]) if len(shape) > 2 else (row,)
    return str(int(where[0])) if len(where) == 1 else str(tuple(int(i) for i in where))


def _check_factors(factor: np.ndarray) -> None:
    values = np.asarray(factor, np.float64)
    if not np.all(np.isfinite(values)) or np.any(values <= 0):
        bad = values[~(np.isfinite(values) & (values > 0))].reshape(-1)[0]
        raise ValueError(f"its factor {float(bad)!r} cannot be applied by rewriting float16 block scales "
                         "(it needs a finite factor > 0)")


class GgmlBlocks(Encoding):
    """One GGUF tensor of ggml quantized blocks (a row, the last NumPy axis, is whole blocks).

    The logical values are ggml's float32 dequantization (``dequantize_row_*``); a
    rescale multiplies every block's f16 ``d`` (and ``dmin``/``m``) by the factor,
    rounded once to f16, so each row can take a factor of its own.
    """

    def __init__(self, name: str, shape: tuple[int, ...], type_id: int, byteorder: str, nbytes: int) -> None:
        self.name, self.shape, self.type_id, self.byteorder = name, shape, type_id, byteorder
        kind = _blocks().GGML_TYPES[type_id]
        self.block_elements, self.block_bytes = kind.block_elements, kind.block_bytes
        self._nbytes = nbytes
        self.row = shape[-1] if shape else 1
        self.rows = math.prod(shape[:-1]) if shape else 1
        self.blocks = nbytes // self.block_bytes
        self._summary = EncodingSummary(kind.name, "GGUF (ggml blocks)", ((name, "blocks", "uint8", (nbytes,)),),
                                        (name,), "any", per_row=True)

    @property
    def summary(self) -> EncodingSummary:
        return self._summary

    @property
    def nbytes(self) -> int:
        return self._nbytes

    def byte_of(self, element: int) -> int:
        """The file offset (relative to the tensor) of the block holding ``element``."""
        return element // self.block_elements * self.block_bytes

    def scaled(self, raw: np.ndarray, first: int, factor: float | np.ndarray | None) -> np.ndarray:
        """Blocks starting at element ``first`` as a rescale by ``factor`` writes them."""
        if factor is None:
            return raw
        blocks = np.asarray(raw, np.uint8).reshape(-1, self.block_bytes)
        per_row = _row_factors(np.asarray(factor), self.rows)
        if per_row is None:
            single = float(np.asarray(factor).reshape(-1)[0])
            out = _blocks().scale_blocks(self.type_id, blocks.reshape(-1), single, self.byteorder).data
            factors: float | np.ndarray = single
        else:
            per = self.row // self.block_elements  # blocks of a row
            factors = per_row[(first // self.block_elements + np.arange(blocks.shape[0])) // per]
            out = blocks.copy()
            for value in np.unique(factors):
                if value == 1.0:
                    continue  # d * 1 rounds to d: nothing to do
                chosen = factors == value
                out[chosen] = _blocks().scale_blocks(self.type_id, blocks[chosen].reshape(-1), float(value),
                                              self.byteorder).data.reshape(-1, self.block_bytes)
            out = out.reshape(-1)
        return out

    def add_row_squares(self, raw: np.ndarray, first: int, out: np.ndarray) -> None:
        """Add the exact sums of squares of blocks starting at element ``first`` to their rows' entries."""
        blocks = raw.size // self.block_bytes
        if not blocks:
            return
        per = self.row // self.block_elements
        row = first // self.row
        if first % self.row == 0 and blocks % per == 0:  # whole rows
            sums = _blocks().block_stats(self.type_id, raw, self.byteorder, group_blocks=per, extremes=False)
            out[row:row + blocks // per] += sums.sum_of_squares
        else:  # a piece of one long row
            out[row] += _blocks().block_stats(self.type_id, raw, self.byteorder, group_blocks=blocks,
                                       extremes=False).sum_of_squares[0]

    def check_landing(self, before: np.ndarray, after: np.ndarray, factor: np.ndarray, path: object) -> None:
        """Refuse a rescale whose result is not the factor times the old values within
        :data:`MAX_SCALE_ROUNDING` of the norm: the whole tensor's for one factor, each row's
        for one factor per row (what ``max_norm`` then checks)."""
        per_row = _row_factors(factor, self.rows)
        if per_row is None:
            checks = [(float(np.asarray(factor).reshape(-1)[0]), math.fsum(before), math.fsum(after), None)]
        else:
            checks = [(float(f), float(b), float(a), r) for r, (f, b, a) in enumerate(zip(per_row, before, after))
                      if f != 1.0]
        for f, squares_before, squares_after, row in checks:
            if not (math.isfinite(squares_before) and math.isfinite(squares_after)) or squares_before == 0:
                continue
            target = f * math.sqrt(squares_before)
            landed = math.sqrt(squares_after)
            if abs(landed - target) > MAX_SCALE_ROUNDING * target:
                where = "" if row is None else f"row {_row_text(row, self.shape)} "
                raise UnsupportedError((f"tensor {self.name!r} ({self._summary.scheme}): rewriting its float16 block "
                                        f"scales by {f:.4g} leaves its {where}norm at {landed:.6g} instead of "
                                        f"{target:.6g} ({landed / target - 1:+.2g}, more than 2**-9 off: the new "
                                        "scales fall among float16's subnormals, which keep too few bits); nothing was "
                                        "written. Requantize it (llama.cpp) rather than clip it, or leave it out "
                                        "with ", Option.EXCLUDE), path)

    def source(self, reader: TensorReader, info: TensorInfo) -> "BlockValues":
        return BlockValues(reader, self)

    def reducer(self, reader: TensorReader, info: TensorInfo, factor: np.ndarray | None = None) -> "BlockReducer":
        return BlockReducer(reader, self, factor)

    def rescale(self, reader: TensorReader, writer: TensorWriter, info: TensorInfo,
                factor: np.ndarray) -> list[tuple[str, Callable[[], int]]]:
        _check_factors(factor)
        _row_factors(factor, self.rows)  # the factors' count is checked before anything is written

        def job() -> int:
            # Bands of whole rows (or of whole blocks of one long row): memory stays bounded.
            row_bytes = self.byte_of(self.row)
            band = max(self.block_bytes, _BAND_BYTES // max(row_bytes, 1) * row_bytes or
                       _BAND_BYTES // self.block_bytes * self.block_bytes)
            before, after = np.zeros(self.rows), np.zeros(self.rows)  # each row's exact sum of squares
            with np.errstate(invalid="ignore", over="ignore"):
                for start in range(0, self.nbytes, band):
                    stop = min(self.nbytes, start + band)
                    raw = np.asarray(reader.read_part(self.name, start, stop), np.uint8)
                    first = start // self.block_bytes * self.block_elements
                    new = self.scaled(raw, first, factor)
                    self.add_row_squares(raw, first, before)
                    self.add_row_squares(new, first, after)
                    writer.write_flat(self.name, start, new)
            self.check_landing(before, after, factor, reader.path)  # (the output is not committed yet)
            return self.nbytes
        return [(self.name, job)]


class NotUnderstood(Encoding):
    """A GGUF tensor of a ggml type tclip does not compute (IQ*, TQ*, Q8_K, MXFP4, ...)."""

    def __init__(self, name: str, shape: tuple[int, ...], type_id: int, nbytes: int) -> None:
        kind = _blocks().type_name(type_id)
        self.name, self._nbytes = name, nbytes
        self._summary = EncodingSummary(kind, "GGUF (ggml blocks)", ((name, "blocks", "uint8", (nbytes,)),),
                                        (), "none", problem=f"ggml type {kind} is not supported")

    @property
    def summary(self) -> EncodingSummary:
        return self._summary

    @property
    def nbytes(self) -> int:
        return self._nbytes

    def source(self, reader: TensorReader, info: TensorInfo) -> Any:
        raise TclipError(f"tensor {self.name!r}: {self._summary.problem}", reader.path)

    def reducer(self, reader: TensorReader, info: TensorInfo, factor: np.ndarray | None = None) -> Any:
        raise TclipError(f"tensor {self.name!r}: {self._summary.problem}", reader.path)

    def rescale(self, reader: TensorReader, writer: TensorWriter, info: TensorInfo,
                factor: np.ndarray) -> list[tuple[str, Callable[[], int]]]:
        raise ValueError(self._summary.problem)


class BlockValues:
    """The logical values of a block tensor, float64 in C order (what ``diff`` compares)."""

    dtype = np.dtype(np.float64)
    parallel_safe = True
    align = 0

    def __init__(self, reader: TensorReader, encoding: GgmlBlocks) -> None:
        self.reader, self.encoding = reader, encoding

    def stored_bytes(self, start: int, stop: int) -> int:
        """What reading elements ``[start, stop)`` reads: the blocks holding them."""
        e = self.encoding
        return e.byte_of(stop + e.block_elements - 1) - e.byte_of(start)

    def read(self, start: int, stop: int, out: np.ndarray | None) -> np.ndarray:
        e = self.encoding
        first = start // e.block_elements * e.block_elements
        raw = np.asarray(self.reader.read_part(e.name, e.byte_of(start), e.byte_of(stop + e.block_elements - 1)),
                         np.uint8)
        result = flat_result(self.dtype, stop - start, out)
        done = 0
        for values in _blocks().dequantize_bands(e.type_id, raw, e.byteorder):
            lo = max(start, first + done)
            hi = min(stop, first + done + values.size)
            if hi > lo:
                result[lo - start:hi - start] = values[lo - first - done:hi - first - done]
            done += values.size
        return result


class BlockReducer:
    """Statistics of units of whole blocks in closed form, and what their scale fields hold.

    Units are runs of whole rows or pieces of one row (``UnitGrid`` cuts a row only into
    runs of its unit size, a multiple of every block size). The sum of squares of a unit
    (or of each of its rows, for ``--axes`` on the last axis) comes from
    :func:`~tclip.quant.ggml.blocks.block_stats`; other axes, sums of ``|x|`` and moments
    need the values, dequantized one unit at a time (at most a unit's worth of float64).
    """

    dtype = np.dtype(np.uint8)  # about one byte per value (Q8_0: 1.06, Q4_K: 0.56)
    parallel_safe = True
    align = 0

    def __init__(self, reader: TensorReader, encoding: GgmlBlocks, factor: np.ndarray | None) -> None:
        self.reader, self.encoding = reader, encoding
        self.factor = None if factor is None else np.asarray(factor, np.float64)

    def read(self, start: int, stop: int, out: np.ndarray | None) -> np.ndarray:
        e = self.encoding
        raw = np.asarray(self.reader.read_part(e.name, e.byte_of(start), e.byte_of(stop)), np.uint8)
        return e.scaled(raw, start, self.factor)

    def reduce(self, raw: np.ndarray, grid: Any, first: int, stop: int, stats: Any, scratch: Any
               ) -> tuple[list[tuple], Findings | None]:
        e = self.encoding
        start = grid.bounds(first)[0]
        findings = Findings(e.name, e.shape) if self.factor is None else None
        ndim = len(e.shape)
        per_row = stats.axes is not None and tuple(stats.axes) == (ndim - 1,)
        as_values = stats.track_l1 or stats.track_moments or (stats.axes is not None and not per_row)
        results = []
        for k in range(first, stop):
            lo, hi = grid.bounds(k)
            part = raw[e.byte_of(lo - start):e.byte_of(hi - start)]
            if as_values:
                values = _blocks().dequantize(e.type_id, part, e.byteorder).astype(np.float64)
                values = values.reshape(grid.unit_shape(k))
                moments = UnitMoments() if stats.track_moments else None
                with np.errstate(invalid="ignore", over="ignore"):  # NaN/Inf blocks: counted, not warned about
                    result = reduce_unit(values, scratch, stats.axes, stats.track_l1, moments)
                results.append((*result, values.size, moments))
            else:
                blocks = (hi - lo) // e.block_elements
                group = min(e.row, hi - lo) // e.block_elements if per_row else blocks
                s = _blocks().block_stats(e.type_id, part, e.byteorder, group_blocks=max(group, 1))
                sum_sq: Any = s.sum_of_squares if per_row else float(s.sum_of_squares[0])
                results.append((sum_sq, float(s.minimum.min()), float(s.maximum.max()), int(s.nan_count.sum()),
                                int(s.inf_count.sum()), 0.0, hi - lo, None))
            if findings is not None:
                _scan_fields(findings, e, part, lo // e.block_elements)
        return results, findings


def _scan_fields(findings: Findings, e: GgmlBlocks, part: np.ndarray, first_block: int) -> None:
    """Count NaN/Inf in every f16 scale field of the blocks, and zero ``d`` where a zero
    ``d`` means a dead block (types without a minimum: all its values are 0).

    Integer tests on the fields' bits, read in place (a strided view where the block size
    and the field's offset are even): the magnitude of an f16 orders like its bits."""
    blocks = np.asarray(part, np.uint8).reshape(-1, e.block_bytes)
    fields = _blocks().GGML_TYPES[e.type_id].scale_fields
    grid = e.shape[:-1] + (e.row // e.block_elements,) if e.shape else (e.blocks,)
    for index, (at, _) in enumerate(fields):
        label = "d" if index == 0 else ("dmin" if e.block_elements == 256 else "m")
        found = findings.scales.setdefault(label, ScaleFindings(f"{e.name} {label}", grid))
        if e.block_bytes % 2 == 0 and at % 2 == 0 and blocks.flags.c_contiguous:
            bits = blocks.view(e.byteorder + "u2")[:, at // 2]
        else:
            bits = np.ascontiguousarray(blocks[:, at:at + 2]).view(e.byteorder + "u2")[:, 0]
        magnitude = bits & np.uint16(0x7FFF)
        found.count += bits.size
        special = magnitude >= 0x7C00
        if special.any():
            nan = magnitude > 0x7C00
            found.nan += int(np.count_nonzero(nan))
            found.inf += int(np.count_nonzero(special & ~nan))
            bad = first_block + int(np.flatnonzero(special)[0])
            found.first_bad = bad if found.first_bad < 0 else min(found.first_bad, bad)
            magnitude = magnitude[~special]
        zero = magnitude == 0
        if index == 0 and len(fields) == 1 and zero.any():  # beside a minimum a zero d is ordinary
            at_zero = first_block + int(np.flatnonzero((bits & np.uint16(0x7FFF)) == 0)[0])
            found.zero += int(np.count_nonzero(zero))
            found.first_zero = at_zero if found.first_zero < 0 else min(found.first_zero, at_zero)
        if magnitude.size:
            largest = int(magnitude.max())
            smallest = int(magnitude.min()) if not zero.any() else int(magnitude[~zero].min(initial=0x7C00))
            if largest:
                found.largest = max(found.largest, float(np.uint16(largest).view(np.float16)))
            if smallest < 0x7C00:
                found.smallest = min(found.smallest, float(np.uint16(smallest).view(np.float16)))


# --------------------------------------------------------------------------- reader


class GgufReader(TensorReader):
    """A GGUF file, v2 or v3, either byte order, opened lazily (the header only)."""

    format_name = NAME

    def __init__(self, path: Path) -> None:
        super().__init__(path)
        from .header import parse_gguf

        # A file cut after its header is listed (info reads headers only); reading its data is refused.
        self.header: GgufHeader = parse_gguf(path, data_may_be_missing=True)
        self.damage = self.header.truncated
        self.split = self.header.split  # (keys out of range are an error, whether or not it stands for a set)
        self._fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        try:
            if os.fstat(self._fd).st_size != self.header.file_size:
                raise FormatError("the file changed while it was opened", path)
            order = self.header.byteorder
            self.offsets: dict[str, int] = {}
            self.ggml_types: dict[str, int] = {}
            self._swapped: set[str] = set()  # big-endian BF16: NumPy has no such dtype
            for key, value in self.header.metadata.items():
                self.metadata[key] = _metadata_value(value, self.header.metadata_types[key])
            for tensor in self.header.tensors:
                self._add(tensor, order)
        except BaseException:
            os.close(self._fd)
            raise

    def _add(self, tensor: GgufTensor, order: str) -> None:
        name, shape, kind = tensor.name, tensor.shape, tensor.ggml_type
        if not tensor.known:
            self.others.append(OtherObject(name, f"tensor of unknown ggml type {kind}", "tclip cannot read it; its "
                                           "bytes are carried as they are", shape, tensor.type_name,
                                           unreadable_type=True))
            return
        assert tensor.nbytes is not None
        self.offsets[name] = tensor.offset
        self.ggml_types[name] = kind
        if kind in _PLAIN:
            self.tensors[name] = TensorInfo(name, shape, np.dtype(order + _PLAIN[kind]))
        elif kind == BF16:
            if order == ">":
                self._swapped.add(name)
            self.tensors[name] = TensorInfo(name, shape, _bfloat16())
        elif kind in quantized_types():
            self.tensors[name] = TensorInfo(name, shape, np.dtype(np.float16), dtype_label=tensor.type_name,
                                            encoding=GgmlBlocks(name, shape, kind, order, tensor.nbytes))
        else:
            self.tensors[name] = TensorInfo(name, shape, np.dtype(np.float16), dtype_label=tensor.type_name,
                                            encoding=NotUnderstood(name, shape, kind, tensor.nbytes))

    def close(self) -> None:
        if self._fd >= 0:
            fd, self._fd = self._fd, -1
            os.close(fd)

    def region(self, name: str) -> tuple[int, int] | None:
        info = self.tensors.get(name)
        if info is None or info.encoding is not None or name in self._swapped:
            return None
        return self._fd, self.offsets[name]

    def parallel_safe(self, name: str) -> bool:
        return True

    def part_parallel_safe(self, name: str) -> bool:
        return True

    def raw(self, name: str, start: int, stop: int, out: np.ndarray | None = None) -> np.ndarray:
        """Bytes ``[start, stop)`` of a tensor's data."""
        result = flat_result(np.dtype(np.uint8), stop - start, out)
        pread_into(self._fd, result.data, self.offsets[name] + start, self.path, name)
        return result

    def read_part(self, name: str, start: int, stop: int, out: np.ndarray | None = None) -> np.ndarray:
        if self.tensors[name].encoding is not None:  # the blocks' raw bytes
            return self.raw(name, start, stop, out)
        return self.read_flat(name, start, stop, out)

    def read_flat(self, name: str, start: int, stop: int, out: np.ndarray | None = None) -> np.ndarray:
        info = self.tensors[name]
        if info.encoding is not None:
            raise TclipError(f"tensor {name!r} is {info.dtype_label} blocks: read it through its encoding", self.path)
        if name in self._swapped:
            data = self.raw(name, start * 2, stop * 2, out).view(">u2")
            data.byteswap(inplace=True)
            return data.view(info.dtype)
        return super().read_flat(name, start, stop, out)

    def read(self, name: str, index: Any = None, scratch: bytearray | None = None) -> np.ndarray:
        info = self.tensors[name]
        if name in self._swapped:
            return self.read_flat(name, 0, info.size).reshape(info.shape)[index if index is not None else ...]
        return read_region(self, name, index)

    def lost_in_conversion(self) -> list[str]:
        return [f"{t.name} ({t.dtype_label} blocks)" for t in self.tensors.values() if t.encoding is not None]


# --------------------------------------------------------------------------- writer


class GgufWriter(PositionalWriter):
    """A rewrite of a GGUF file: everything copied byte for byte at its offset, then the
    rewritten tensors' data written in place (values, or blocks with new scales)."""

    format_name = NAME

    def __init__(self, target: Path, tensors: list[TensorInfo], output: AtomicOutput, *,
                 like: TensorReader | None, metadata: dict[str, str] | None,
                 rewritten: Collection[str] | None) -> None:
        if not isinstance(like, GgufReader):
            raise UnsupportedError("tclip writes GGUF files only by rewriting a GGUF file (no conversion into "
                                   "GGUF: its quantized types and metadata come from llama.cpp's converters)",
                                   target)
        if metadata is not None or {t.name for t in tensors} != set(like.tensors):
            raise UnsupportedError("a GGUF file is rewritten with all of its tensors and metadata as they are",
                                   target)
        super().__init__(target, [like.tensors[t.name] for t in tensors], output)
        self.like = like
        self.offsets = {name: like.offsets[name] for name in self.tensors}
        self._swapped = {name for name in like._swapped if name in self.tensors}
        self._fd = self.output.open()
        size = like.header.file_size
        os.ftruncate(self._fd, size)
        anew = set(self.tensors) if rewritten is None else {n for n in rewritten if n in self.tensors}
        holes = [(self.offsets[n], self.tensors[n].nbytes) for n in anew]
        copy_except(like._fd, self._fd, size, holes, like.path)
        self._copied = set(self.tensors) - anew

    def write_flat(self, name: str, start: int, data: np.ndarray) -> None:
        if name in self._swapped:  # back to the file's big-endian bfloat16
            data = np.asarray(data).astype(self.tensors[name].dtype).view("<u2").byteswap()
            super().write_flat(name, start, data.view(self.tensors[name].dtype))
            return
        super().write_flat(name, start, data)

    def copy_tensor(self, reader: TensorReader, name: str, max_bytes: int = 1 << 20) -> None:
        if name in self._copied:  # copied with the rest of the file
            with self._lock:
                self._written[name] = self._written.get(name, 0) + self._items(name)
            return
        super().copy_tensor(reader, name, max_bytes)


Reader = GgufReader
Writer = GgufWriter
