"""A GGUF tensor of ggml blocks as one logical tensor: its values, statistics and rescale.

The GGUF reader (:mod:`tclip.formats.gguf`) lists such a tensor as stored blocks tagged with
their ggml type (:class:`~tclip.formats.gguf.files.GgmlStored`); :func:`decode` gives it the
encoding that computes (:mod:`tclip.quant.view` does so for every reader it opens):

- Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K: :class:`GgmlBlocks`, the
  statistics of ggml's float32 values in closed form (``block_stats``), the NaN/Inf scan of
  every block's ``d``/``dmin``/``m``, rescaled by rewriting those f16 fields only
  (``scale_blocks``: codes keep their bytes);
- the other types ggml defines (IQ*, TQ*, Q8_K, MXFP4, ...): :class:`NotUnderstood`, listed,
  never measured, refused for clipping.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import numpy as np

from ...core.kernels import UnitMoments, reduce_unit
from ...core.stats import TensorStats
from ...core.units import UnitGrid
from ...errors import TclipError, UnsupportedError
from ...formats.base import EncodingSummary, TensorInfo, TensorReader, TensorWriter
from ...formats._io import flat_result
from ...formats.gguf.files import GgmlStored
from ...messages import Option
from .. import ggml
from ..codes import Findings, ScaleFindings
from ..contract import QuantEncoding, Rescale, UnitResult

# Bytes of blocks read at once by a rescale or a value source.
_BAND_BYTES = 8 << 20
# How far a rescaled tensor's norm (or row's, with one factor per row) may land from the
# factor times the old one, relative: the max_norm gate's tolerance for float16, so a clipped
# tensor passes it. Rounding normal f16 scales moves a block by at most 2**-11 and a tensor's
# norm by far less; only scales pushed deep among the subnormals move it more.
MAX_SCALE_ROUNDING = 2.0 ** -9


@functools.cache
def quantized_types() -> frozenset[int]:
    """Quantized types whose values tclip computes and whose scales it rewrites."""
    return frozenset(t for t in ggml.GGML_TYPES if ggml.is_supported(t) and ggml.can_scale(t))


def decode(stored: GgmlStored) -> QuantEncoding:
    """The encoding that computes a GGUF tensor's values from its stored blocks."""
    if stored.type_id in quantized_types():
        return GgmlBlocks(stored.name, stored.shape, stored.type_id, stored.byteorder, stored.nbytes)
    return NotUnderstood(stored.name, stored.shape, stored.type_id, stored.nbytes)


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


class GgmlBlocks(QuantEncoding):
    """One GGUF tensor of ggml quantized blocks (a row, the last NumPy axis, is whole blocks).

    The logical values are ggml's float32 dequantization (``dequantize_row_*``); a
    rescale multiplies every block's f16 ``d`` (and ``dmin``/``m``) by the factor,
    rounded once to f16, so each row can take a factor of its own.
    """

    def __init__(self, name: str, shape: tuple[int, ...], type_id: int, byteorder: str, nbytes: int) -> None:
        self.name, self.shape, self.type_id, self.byteorder = name, shape, type_id, byteorder
        kind = ggml.GGML_TYPES[type_id]
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
            out = ggml.scale_blocks(self.type_id, blocks.reshape(-1), single, self.byteorder).data
            factors: float | np.ndarray = single
        else:
            per = self.row // self.block_elements  # blocks of a row
            factors = per_row[(first // self.block_elements + np.arange(blocks.shape[0])) // per]
            out = blocks.copy()
            for value in np.unique(factors):
                if value == 1.0:
                    continue  # d * 1 rounds to d: nothing to do
                chosen = factors == value
                out[chosen] = ggml.scale_blocks(self.type_id, blocks[chosen].reshape(-1), float(value),
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
            sums = ggml.block_stats(self.type_id, raw, self.byteorder, group_blocks=per, extremes=False)
            out[row:row + blocks // per] += sums.sum_of_squares
        else:  # a piece of one long row
            out[row] += ggml.block_stats(self.type_id, raw, self.byteorder, group_blocks=blocks,
                                       extremes=False).sum_of_squares[0]

    def check_landing(self, before: np.ndarray, after: np.ndarray, factor: np.ndarray, path: object) -> None:
        """Refuse a rescale whose result is not the factor times the old values within
        :data:`MAX_SCALE_ROUNDING` of the norm: the whole tensor's for one factor, each row's
        for one factor per row (what ``max_norm`` then checks)."""
        per_row = _row_factors(factor, self.rows)
        checks: list[tuple[float, float, float, int | None]]
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
                factor: np.ndarray) -> Rescale:
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


class NotUnderstood(QuantEncoding):
    """A GGUF tensor of a ggml type tclip does not compute (IQ*, TQ*, Q8_K, MXFP4, ...)."""

    def __init__(self, name: str, shape: tuple[int, ...], type_id: int, nbytes: int) -> None:
        kind = ggml.type_name(type_id)
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
                factor: np.ndarray) -> Rescale:
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
        for values in ggml.dequantize_bands(e.type_id, raw, e.byteorder):
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
    :func:`~tclip.quant.ggml.block_stats`; other axes, sums of ``|x|`` and moments
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

    def reduce(self, raw: np.ndarray, grid: UnitGrid, first: int, stop: int, stats: TensorStats, scratch: Any
               ) -> tuple[list[UnitResult], Findings | None]:
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
                values = ggml.dequantize(e.type_id, part, e.byteorder).astype(np.float64)
                values = values.reshape(grid.unit_shape(k))
                moments = UnitMoments() if stats.track_moments else None
                with np.errstate(invalid="ignore", over="ignore"):  # NaN/Inf blocks: counted, not warned about
                    result = reduce_unit(values, scratch, stats.axes, stats.track_l1, moments)
                results.append(UnitResult(*result, values.size, moments))
            else:
                blocks = (hi - lo) // e.block_elements
                group = min(e.row, hi - lo) // e.block_elements if per_row else blocks
                s = ggml.block_stats(e.type_id, part, e.byteorder, group_blocks=max(group, 1))
                sum_sq: Any = s.sum_of_squares if per_row else float(s.sum_of_squares[0])
                results.append(UnitResult(sum_sq, float(s.minimum.min()), float(s.maximum.max()),
                                          int(s.nan_count.sum()), int(s.inf_count.sum()), 0.0, hi - lo, None))
            if findings is not None:
                _scan_fields(findings, e, part, lo // e.block_elements)
        return results, findings


def _scan_fields(findings: Findings, e: GgmlBlocks, part: np.ndarray, first_block: int) -> None:
    """Count NaN/Inf in every f16 scale field of the blocks, and zero ``d`` where a zero
    ``d`` means a dead block (types without a minimum: all its values are 0).

    Integer tests on the fields' bits, read in place (a strided view where the block size
    and the field's offset are even): the magnitude of an f16 orders like its bits."""
    blocks = np.asarray(part, np.uint8).reshape(-1, e.block_bytes)
    fields = ggml.GGML_TYPES[e.type_id].scale_fields
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
