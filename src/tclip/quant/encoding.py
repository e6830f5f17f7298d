"""Quantized weights stored as codes plus scale tensors: their encoding.

:class:`BlockScaled` is the :class:`~tclip.quant.contract.QuantEncoding` of every
convention :mod:`tclip.quant.layout` understands (codes times block scales, times or
divided by a global scale); :class:`Undecoded` stands for a weight recognised as
quantized but not understood. :mod:`tclip.quant.view` lists them in place of their parts.

The arithmetic is :mod:`tclip.quant.codes`'; this module only reads the parts
(from whichever file of a set holds them) and cuts them into units.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from ..core.kernels import Scratch, UnitMoments, reduce_unit
from .codes import (
    CODE_FORMATS,
    Findings,
    ScaleFindings,
    UnitCodes,
    byte_scale_table,
    closed_form,
    code_faults,
    dequantize,
    is_power_of_two,
    round_product,
    round_quotient,
    scale_values,
    shift_e8m0,
    widen_bytes,
)
from ..core.stats import TensorStats, UnitResult
from ..core.units import UnitGrid
from ..errors import TclipError, UnsupportedError
from ..formats.base import EncodingSummary, TensorInfo, TensorReader, TensorWriter
from ..messages import Option
from .contract import QuantEncoding, Rescale
from .layout import QuantWeight

# Scales read and rewritten per step of a rescale: a few MiB.
RESCALE_CHUNK = 1 << 20


class BlockGrid:
    """Index arithmetic of a weight ``[..., R, C]`` with one scale per ``bh x bw`` block: row
    ``g`` (of the ``lead * R`` rows) is in *band* ``(g // R) * nbr + (g % R) // bh``, and the
    scale tensor is read as ``[lead * nbr, nbc]``."""

    def __init__(self, shape: tuple[int, ...], block: tuple[int, int]) -> None:
        self.shape = shape
        self.rows, self.cols = shape[-2], shape[-1]
        # A weight without rows or columns fits a block of none: count it as 1 ([4, 0] with [4, 1] scales).
        self.bh, self.bw = max(block[0], 1), max(block[1], 1)
        self.lead = math.prod(shape[:-2])
        self.nbr, self.nbc = -(-self.rows // self.bh), -(-self.cols // self.bw)
        self.bands = self.lead * self.nbr

    def band(self, row: np.ndarray | int) -> np.ndarray | int:
        return (row // self.rows) * self.nbr + (row % self.rows) // self.bh

    def band_start(self, band: np.ndarray | int) -> np.ndarray | int:
        """The first row of each band."""
        return (band // self.nbr) * self.rows + (band % self.nbr) * self.bh


class BlockScaled(QuantEncoding):
    """Codes times block scales (times or divided by a global scale): see :mod:`tclip.quant.codes`."""

    def __init__(self, weight: QuantWeight, dtype: np.dtype, nbytes: int) -> None:
        assert weight.scheme is not None
        self.weight = weight
        self.scheme = weight.scheme
        self.fmt = CODE_FORMATS[self.scheme.codes]
        self.grid = BlockGrid(weight.shape, self.scheme.block)
        self.codes = weight.codes
        self.scales = weight.part("scales")
        self.global_scale = weight.part("global scale")
        self.dtype = dtype
        self._nbytes = nbytes
        self.scales_itemsize = 0 if self.scales is None else np.dtype(self.scales.dtype).itemsize
        rescaled = weight.rescaled
        self.e8m0_rescale = rescaled is not None and rescaled.role == "scales" and self.scheme.e8m0
        self._summary = EncodingSummary(
            self.scheme.label, self.scheme.convention,
            tuple((p.name, p.role, p.dtype, p.shape) for p in weight.parts),
            (rescaled.name,) if rescaled is not None else (),
            "power of two" if self.e8m0_rescale else "any",
            per_row=rescaled is not None and rescaled.role == "scales" and self.scheme.block[0] == 1)

    @property
    def summary(self) -> EncodingSummary:
        return self._summary

    @property
    def nbytes(self) -> int:
        return self._nbytes

    def source(self, reader: TensorReader, info: TensorInfo) -> "ValueSource":
        return ValueSource(self, reader)

    def reducer(self, reader: TensorReader, info: TensorInfo, factor: np.ndarray | None = None) -> "CodeSource":
        return CodeSource(self, reader, factor)

    # ------------------------------------------------------------------ scales

    def read_scales(self, reader: TensorReader, start: int, stop: int) -> np.ndarray:
        """Scale elements ``[start, stop)`` as stored (raw dtype)."""
        assert self.scales is not None
        return reader.read_part(self.scales.name, start, stop)

    def global_value(self, reader: TensorReader) -> float | None:
        if self.global_scale is None:
            return None
        return float(np.asarray(reader.read_part(self.global_scale.name, 0, 1)).astype(np.float64)[0])

    def new_scales(self, raw: np.ndarray, factor: np.ndarray, first_band: int) -> np.ndarray:
        """Block scales ``raw`` (bands ``first_band..``, flat ``[bands * nbc]``) as a rescale by
        ``factor`` writes them (raw dtype)."""
        factor = np.asarray(factor, np.float64)
        if factor.ndim:  # one factor per row: each band is one row (bh == 1)
            bands = raw.size // self.grid.nbc
            per_band = factor.reshape(-1)[first_band:first_band + bands]
            factor = np.repeat(per_band, self.grid.nbc)
        if self.scheme.e8m0:
            if factor.ndim:
                out = np.empty(raw.size, np.uint8)
                flat = np.asarray(raw).view(np.uint8).reshape(-1)
                for value in np.unique(factor):
                    chosen = factor == value
                    out[chosen] = shift_e8m0(flat[chosen], float(value))
                return out.view(raw.dtype)
            return shift_e8m0(raw, float(factor)).view(raw.dtype)
        return round_product(np.asarray(raw).astype(np.float64), factor, raw.dtype)

    def new_global(self, value: float, factor: float, dtype: np.dtype) -> Any:
        if self.scheme.global_op == "divide":
            return round_quotient(value, factor, dtype)
        return round_product(np.asarray([value]), factor, dtype)[0]

    def check_factor(self, factor: np.ndarray) -> None:
        factor = np.asarray(factor, np.float64)
        if factor.ndim and not self._summary.per_row:
            raise ValueError(f"{self.weight.name}: one factor per row needs one scale per row")
        if self.e8m0_rescale and not all(is_power_of_two(float(f)) or f == 1.0 for f in np.unique(factor)):
            raise ValueError(f"{self.weight.name}: E8M0 scales take powers of two only")

    def rescale(self, reader: TensorReader, writer: TensorWriter, info: TensorInfo,
                factor: np.ndarray) -> Rescale:
        self.check_factor(factor)
        rescaled = self.weight.rescaled
        assert rescaled is not None
        if not math.prod(self.weight.shape):
            return []  # no values to scale: the scales are copied as they are
        if rescaled.role == "global scale":
            def job() -> int:
                raw = np.asarray(reader.read_part(rescaled.name, 0, 1))
                new = self.new_global(float(raw.astype(np.float64)[0]), float(factor), raw.dtype)
                writer.write_flat(rescaled.name, 0, np.asarray([new], raw.dtype))
                return raw.nbytes
            return [(rescaled.name, job)]

        def scales_job() -> int:
            total = math.prod(rescaled.shape)
            step = max(self.grid.nbc, RESCALE_CHUNK // self.grid.nbc * self.grid.nbc)
            done = 0
            for start in range(0, total, step):
                stop = min(total, start + step)
                raw = np.asarray(reader.read_part(rescaled.name, start, stop))
                writer.write_flat(rescaled.name, start, self.new_scales(raw, factor, start // self.grid.nbc))
                done += raw.nbytes
            return done
        return [(rescaled.name, scales_job)]


class Undecoded(QuantEncoding):
    """A weight recognised as quantized but not understood: listed, never read nor rescaled."""

    def __init__(self, weight: QuantWeight, nbytes: int) -> None:
        self.weight = weight
        self._nbytes = nbytes
        self._summary = EncodingSummary("quantized", "not understood",
                                        tuple((p.name, p.role, p.dtype, p.shape) for p in weight.parts),
                                        (), "none", False, weight.problem or "not understood")

    @property
    def summary(self) -> EncodingSummary:
        return self._summary

    @property
    def nbytes(self) -> int:
        return self._nbytes

    def source(self, reader: TensorReader, info: TensorInfo) -> Any:
        raise TclipError(f"tensor {self.weight.name!r}: {self._summary.problem}", reader.path)

    reducer = source  # type: ignore[assignment]

    def rescale(self, reader: TensorReader, writer: TensorWriter, info: TensorInfo,
                factor: np.ndarray) -> Rescale:
        raise ValueError(f"{self.weight.name}: {self._summary.problem}")


# --------------------------------------------------------------------------- reading


class _Raw:
    """The stored data of elements ``[start, stop)``: codes (uint8, as stored) and the scales of
    the bands they touch (float64, as read or as a rescale leaves them; ``old_scales``: as read,
    where a rescale changed them). One-byte scales read without a rescale stay bytes
    (``scale_bytes``, uint8, with their values' ``table``) until something asks for ``scales``."""

    __slots__ = ("start", "stop", "codes", "first_band", "_scales", "raw_scales", "nbytes", "_old",
                 "scale_bytes", "table")

    def __init__(self, start: int, stop: int, codes: np.ndarray, first_band: int, scales: np.ndarray | None,
                 raw_scales: np.ndarray, old_scales: np.ndarray | None = None,
                 scale_bytes: np.ndarray | None = None, table: np.ndarray | None = None) -> None:
        self.start, self.stop, self.codes = start, stop, codes
        self.first_band, self._scales, self.raw_scales = first_band, scales, raw_scales
        self.nbytes = codes.nbytes + raw_scales.nbytes
        self._old, self.scale_bytes, self.table = old_scales, scale_bytes, table

    @property
    def scales(self) -> np.ndarray:
        if self._scales is None:
            assert self.scale_bytes is not None and self.table is not None
            self._scales = widen_bytes(self.scale_bytes, self.table)
        return self._scales

    @property
    def old_scales(self) -> np.ndarray:
        return self.scales if self._old is None else self._old


def _leaves_normal_range(values: np.ndarray, products: np.ndarray, dtype: np.dtype) -> bool:
    """Whether any finite, non-zero value's product falls below ``dtype``'s smallest normal
    value (or to zero) or beyond its largest (float64 values and products)."""
    import ml_dtypes

    info = ml_dtypes.finfo(dtype)
    with np.errstate(invalid="ignore", over="ignore"):
        magnitude = np.abs(products)
        live = np.isfinite(values) & (values != 0)
        return bool(np.any(live & ((magnitude < float(info.tiny)) | (magnitude > float(info.max)))))


def _row_text(row: int, shape: tuple[int, ...]) -> str:
    where = np.unravel_index(row, shape[:-1]) if len(shape) > 2 else (row,)
    return str(int(where[0])) if len(where) == 1 else str(tuple(int(i) for i in where))


class _Landing:
    """What a rescale leaves of each unit against what it held: the exact sums of squares
    before and after (of the unit, or of each row it touches, by row) and the non-zero values
    it made zero. Kept per unit and added up in unit order, whatever the threads."""

    def __init__(self) -> None:
        self.units: dict[int, tuple[int, np.ndarray, np.ndarray, int]] = {}

    def add(self, k: int, first_row: int, before: np.ndarray, after: np.ndarray, flushed: int) -> None:
        self.units[k] = (first_row, before, after, flushed)

    def flushed(self) -> int:
        return sum(unit[3] for unit in self.units.values())

    def totals(self, rows: int | None) -> tuple[np.ndarray, np.ndarray]:
        """The sums of squares before and after: of the tensor (one entry), or per row."""
        before, after = np.zeros(rows or 1), np.zeros(rows or 1)
        for k in sorted(self.units):
            first_row, b, a, _ = self.units[k]
            if rows is None:
                before[0] += float(np.sum(b))
                after[0] += float(np.sum(a))
            else:
                before[first_row:first_row + b.size] += b
                after[first_row:first_row + a.size] += a
        return before, after


class CodeSource:
    """Pass 1 (and pass 2's after-statistics) of a :class:`BlockScaled` weight, in closed form."""

    dtype = np.dtype(np.uint8)  # a code costs the block budget at most a byte
    align = 0
    # Twice the elements of a unit of values: a code is a byte or half of one, and the
    # per-unit work (some 40 NumPy calls) weighs less (measured: -25% CPU for FP8).
    unit_elements = 1 << 19

    def __init__(self, encoding: BlockScaled, reader: TensorReader, factor: np.ndarray | None = None) -> None:
        self.encoding, self.reader, self.factor = encoding, reader, factor
        names = [p.name for p in encoding.weight.parts]
        self.parallel_safe = all(reader.part_parallel_safe(n) for n in names)
        grid = encoding.grid
        self.global_raw = encoding.global_value(reader)
        self.global_value = self.global_raw
        if factor is not None:
            encoding.check_factor(factor)
            if encoding.scheme.global_op is not None and self.global_raw is not None:
                part = encoding.global_scale
                assert part is not None
                dtype = np.asarray(reader.read_part(part.name, 0, 1)).dtype
                self.global_value = float(np.asarray(encoding.new_global(self.global_raw, float(factor), dtype),
                                                     np.float64))
        self.rescale_blocks = factor is not None and encoding.scheme.global_op is None
        self.grid = grid
        # With a factor: what the rescale leaves against what was (check_landing), where it may
        # miss. E8M0 scales move by exact powers of two (or are refused): they never do.
        self.landing = _Landing() if factor is not None and not encoding.e8m0_rescale and self._may_miss() \
            else None

    def _may_miss(self) -> bool:
        """Whether some scale times the factor leaves its dtype's normal range (below its smallest
        normal value, to zero, or past its largest), read from the scales alone. Within it every
        rewritten scale is the exact product within half a unit in the last place, and so is
        the weight's norm (and each row's): no check is needed, nor the walk it takes."""
        encoding, factor = self.encoding, np.asarray(self.factor, np.float64)
        rescaled = encoding.weight.rescaled
        assert rescaled is not None
        if rescaled.role == "global scale":
            if self.global_raw is None:
                return False
            raw = np.asarray([self.global_raw], np.float64)
            product = raw / factor.reshape(-1)[:1] if encoding.scheme.global_op == "divide" \
                else raw * factor.reshape(-1)[:1]
            return _leaves_normal_range(raw, product, np.asarray(self.reader.read_part(rescaled.name, 0, 1)).dtype)
        total, nbc = math.prod(rescaled.shape), max(self.grid.nbc, 1)
        step = max(nbc, RESCALE_CHUNK // nbc * nbc)
        for start in range(0, total, step):
            raw = np.asarray(self.reader.read_part(rescaled.name, start, min(total, start + step)))
            values = raw.astype(np.float64).reshape(-1)
            if factor.ndim:  # one factor per row: each band is one row
                per_band = factor.reshape(-1)[start // nbc:start // nbc + -(-values.size // nbc)]
                product = values * np.repeat(per_band, nbc)[:values.size]
            else:
                product = values * float(factor)
            if _leaves_normal_range(values, product, raw.dtype):
                return True
        return False

    def read(self, start: int, stop: int, out: np.ndarray | None) -> _Raw:
        encoding, grid = self.encoding, self.grid
        per_byte = encoding.fmt.per_byte
        if start % per_byte or stop % per_byte:
            raise TclipError(f"internal error: a run of {encoding.weight.name!r} splits a byte of codes")
        first, last = start // per_byte, stop // per_byte
        codes = np.asarray(self.reader.read_part(encoding.codes.name, first, last,
                                                 None if out is None or out.size < last - first else out))
        codes = codes.view(np.uint8).reshape(-1)
        first_band = int(grid.band((start // grid.cols)))
        last_band = int(grid.band((stop - 1) // grid.cols)) if stop > start else first_band
        raw = np.asarray(encoding.read_scales(self.reader, first_band * grid.nbc, (last_band + 1) * grid.nbc))
        stored = raw
        old = None
        if self.rescale_blocks:
            raw = encoding.new_scales(raw.reshape(-1), self.factor, first_band)  # type: ignore[arg-type]
            old = scale_values(stored, encoding.scheme.e8m0).reshape(-1, grid.nbc)
        else:
            table = byte_scale_table(raw, encoding.scheme.e8m0)
            if table is not None:  # one-byte scales: looked up where they are used, in C for the norms
                return _Raw(start, stop, codes, first_band, None, stored, None,
                            raw.view(np.uint8).reshape(-1, grid.nbc), table)
        scales = scale_values(raw, encoding.scheme.e8m0).reshape(-1, grid.nbc)
        return _Raw(start, stop, codes, first_band, scales, stored, old)

    def units(self, data: _Raw, grid: UnitGrid, first: int, stop: int) -> Any:
        """Each unit ``k`` as (k, its element range, its :class:`UnitCodes`, the unit's shape)."""
        per_byte = self.encoding.fmt.per_byte
        for k in range(first, stop):
            lo, hi = grid.bounds(k)
            codes = data.codes[(lo - data.start) // per_byte:(hi - data.start) // per_byte]
            yield k, lo, hi, self.rows(codes, lo, hi, data), grid.unit_shape(k)

    def rows(self, codes: np.ndarray, lo: int, hi: int, data: _Raw, old: bool = False) -> UnitCodes:
        """Elements ``[lo, hi)`` (whole rows, or a piece of one) as :class:`UnitCodes` (``old``: with
        the scales as stored, before a rescale)."""
        blocks = self.grid
        cols = blocks.cols
        if hi - lo >= cols and lo % cols == 0:
            rows, col0, width = (hi - lo) // cols, 0, cols
        else:
            rows, col0, width = 1, lo % cols, hi - lo
        row0 = lo // cols
        first_band, last_band = int(blocks.band(row0)), int(blocks.band(row0 + rows - 1))
        columns = slice(col0 // blocks.bw, (col0 + width - 1) // blocks.bw + 1)
        bands = slice(first_band - data.first_band, last_band - data.first_band + 1)
        table = data.table  # one-byte scales as read (never beside a rescale): old or new, the same
        scales = data.scale_bytes[bands, columns] if data.scale_bytes is not None \
            else (data.old_scales if old else data.scales)[bands, columns]
        runs = None
        if blocks.bh > 1 or last_band - first_band + 1 < rows:  # bands are consecutive: one run of rows each
            runs, start = [], row0
            while start < row0 + rows:
                stop = min(row0 + rows, int(blocks.band_start(int(blocks.band(start)) + 1)))
                runs.append((start - row0, stop - row0))
                start = stop
        return UnitCodes(self.encoding.fmt, codes.reshape(rows, -1), col0, width, blocks.bw, scales, runs, table)

    @np.errstate(invalid="ignore", over="ignore", divide="ignore")  # Inf/NaN are counted, not warned of
    def reduce(self, data: _Raw, grid: UnitGrid, first: int, stop: int, stats: TensorStats,
               scratch: Scratch | None) -> tuple[list[UnitResult], Findings | None]:
        encoding = self.encoding
        op, global_value = encoding.scheme.global_op, self.global_value
        findings = Findings(encoding.codes.name, encoding.weight.shape) if self.factor is None else None
        results = []
        bands: list[list[int]] = []  # the bands whose scales these units count, consecutive ones merged
        for k, lo, hi, unit, shape in self.units(data, grid, first, stop):
            axes = stats.axes
            row_axes = axes is not None and axes == (len(shape) - 1,)
            sums, largest, smallest = closed_form(unit, row_axes, None if scratch is None else scratch.wide)
            if op is not None:
                sums, largest, smallest = _scaled_by_global(sums, largest, smallest, op, global_value)
            total = float(np.add.reduce(sums))  # finite: so is every sum (none is negative); else look
            finite = (math.isfinite(total) or bool(np.isfinite(sums).all())) and math.isfinite(largest) \
                and math.isfinite(smallest)
            moments = None
            nans = infs = 0
            sum_abs = 0.0
            closed: Any = None
            if finite and (axes is None or row_axes):
                closed = total if axes is None else sums.reshape(shape[:-1])
            if closed is not None and not stats.track_moments and not stats.track_l1:
                sum_sq: Any = closed
            else:
                values = self._values(unit, scratch, op, global_value).reshape(shape)
                moments = UnitMoments() if stats.track_moments else None
                wide_sum, low, high, nans, infs, sum_abs = reduce_unit(values, scratch, axes, stats.track_l1,
                                                                       moments, values, extremes=not finite)
                sum_sq = closed if closed is not None else wide_sum
                if not finite:
                    largest, smallest = high, low
                    if findings is not None:
                        bad_nan, bad_inf, at = code_faults(unit)
                        findings.nan_codes += bad_nan
                        findings.inf_codes += bad_inf
                        if at >= 0:  # a unit is one run of the tensor: its flat index is lo + at
                            findings.first_bad_code = lo + at if findings.first_bad_code < 0 \
                                else min(findings.first_bad_code, lo + at)
            if findings is not None:
                self._scale_findings(findings, lo, hi, bands)
            elif self.landing is not None and finite:
                self._land(k, lo, hi, data, unit, sums if row_axes else np.asarray([closed]), row_axes)
            results.append(UnitResult(sum_sq, smallest, largest, nans, infs, sum_abs, hi - lo, moments))
        if findings is not None:
            self._add_scales(findings, data, bands)
        return results, findings

    def _land(self, k: int, lo: int, hi: int, data: _Raw, unit: UnitCodes, after: np.ndarray,
              per_row: bool) -> None:
        """Record unit ``k``'s exact sums of squares before the rescale beside those after it,
        and how many of its non-zero values the rescale made zero."""
        assert self.landing is not None
        encoding = self.encoding
        op = encoding.scheme.global_op
        old = self.rows(unit.raw, lo, hi, data, old=True) if self.rescale_blocks else unit
        before = closed_form(old, per_row)[0]
        if op is not None:
            before = _apply_global(before, 0.0, 0.0, op, self.global_raw)[0]
        if not per_row:
            before = np.asarray([float(np.add.reduce(before))])
        flushed = 0
        if (self.rescale_blocks and np.any((unit.scales == 0) & (old.scales != 0))) or \
                (op is not None and self.global_value == 0 and self.global_raw != 0):
            with np.errstate(invalid="ignore", over="ignore", divide="ignore"):
                flushed = int(np.count_nonzero(self._values(old, None, op, self.global_raw))
                              - np.count_nonzero(self._values(unit, None, op, self.global_value)))
        self.landing.add(k, lo // self.grid.cols if self.grid.cols else 0, before, np.asarray(after, np.float64),
                         flushed)

    def flushed(self) -> int:
        """Non-zero values the rescale made zero (after a walk with a factor)."""
        return 0 if self.landing is None else self.landing.flushed()

    def check_landing(self, tolerance: float, path: object) -> None:
        """Refuse a rescale that does not leave the weight -- each row, with one factor per row --
        at the factor times its old norm within ``tolerance``, relative (its scales' rounding:
        among float16's subnormals, or flushed to zero, they keep too few bits). Called after a
        walk with the factor, before anything is committed."""
        if self.landing is None or self.factor is None:
            return
        factor = np.asarray(self.factor, np.float64).reshape(-1)
        rows = None if factor.size == 1 else factor.size
        before, after = self.landing.totals(rows)
        name, scheme = self.encoding.weight.name, self.encoding.scheme.label
        for row, (f, squares_before, squares_after) in enumerate(zip(np.broadcast_to(factor, before.shape),
                                                                     before, after)):
            if f == 1.0 or not (math.isfinite(squares_before) and math.isfinite(squares_after)) \
                    or squares_before == 0:
                continue
            target = float(f) * math.sqrt(squares_before)
            landed = math.sqrt(squares_after)
            if abs(landed - target) > tolerance * target:
                where = "" if rows is None else f"row {_row_text(row, self.encoding.weight.shape)} "
                bound = f"2**{math.log2(tolerance):.0f}" if math.log2(tolerance).is_integer() else f"{tolerance:.3g}"
                scales = self.encoding.weight.rescaled
                part = "" if scales is None else f" {scales.name!r} ({scales.dtype})"
                raise UnsupportedError((f"tensor {name!r} ({scheme}): rewriting its scales{part} by {f:.4g} leaves "
                                        f"its {where}norm at {landed:.6g} instead of {target:.6g} "
                                        f"({landed / target - 1:+.2g}, more than {bound} off: the new scales fall "
                                        "among their dtype's subnormals or to zero, which keep too few bits); "
                                        "nothing was written. Requantize it rather than clip it, or leave it out "
                                        "with ", Option.EXCLUDE), path)

    def _values(self, unit: UnitCodes, scratch: Scratch | None, op: str | None, global_value: float | None
                ) -> np.ndarray:
        values = dequantize(unit, None if scratch is None else scratch.wide)
        if op == "multiply":
            values *= global_value
        elif op == "divide":
            with np.errstate(divide="ignore", invalid="ignore"):
                values /= global_value
        return values

    def _scale_findings(self, findings: Findings, lo: int, hi: int, bands: list[list[int]]) -> None:
        """Count each scale once: a band's scales belong to the unit holding the band's first element
        (its bands go to ``bands``, counted by :meth:`_add_scales` after the units)."""
        encoding, blocks = self.encoding, self.grid
        cols = blocks.cols
        if lo % cols == 0:
            row0, row1 = lo // cols, -(-hi // cols)
            first_band, last_band = int(blocks.band(row0)), int(blocks.band(row1 - 1))
            if int(blocks.band_start(first_band)) < row0:
                first_band += 1
            if first_band <= last_band:
                scales = encoding.scales
                assert scales is not None
                if scales.name not in findings.scales:  # made here: the entries keep their order
                    findings.scales[scales.name] = ScaleFindings(scales.name, scales.shape)
                if bands and bands[-1][1] + 1 == first_band:
                    bands[-1][1] = last_band
                else:
                    bands.append([first_band, last_band])
        if lo == 0 and encoding.global_scale is not None and self.global_raw is not None:
            part = encoding.global_scale
            found = findings.scales.setdefault(part.name, ScaleFindings(part.name, part.shape))
            found.add(np.asarray([self.global_raw]), 0)
            findings.global_value = self.global_raw


    def _add_scales(self, findings: Findings, data: _Raw, bands: list[list[int]]) -> None:
        """Count the scales of ``bands`` (runs of consecutive bands: their scales are one run each,
        one add for all the units of a read, not one a unit or a row)."""
        scales, nbc = self.encoding.scales, self.grid.nbc
        if not bands or scales is None:
            return
        found = findings.scales.setdefault(scales.name, ScaleFindings(scales.name, scales.shape))
        for first_band, last_band in bands:
            run = slice(first_band - data.first_band, last_band + 1 - data.first_band)
            if data.scale_bytes is not None and data.table is not None:
                found.add_bytes(data.scale_bytes[run], data.table, first_band * nbc)
            else:
                found.add(data.old_scales[run], first_band * nbc)  # the stored scales' values


def _apply_global(row_sums: np.ndarray, largest: float, smallest: float, op: str, value: float | None
                  ) -> tuple[np.ndarray, float, float]:
    with np.errstate(invalid="ignore", over="ignore", divide="ignore"):
        return _scaled_by_global(row_sums, largest, smallest, op, value)


def _scaled_by_global(row_sums: np.ndarray, largest: float, smallest: float, op: str, value: float | None
                      ) -> tuple[np.ndarray, float, float]:
    """:func:`_apply_global` where the caller has silenced NumPy's overflow warnings (once, not a unit)."""
    g = math.nan if value is None else value
    if op == "multiply":
        sums, a, b = row_sums * (g * g), largest * g, smallest * g
    else:
        sums, a, b = row_sums / (g * g), largest / g, smallest / g
    return sums, max(a, b), min(a, b)


class ValueSource:
    """A :class:`BlockScaled` weight's real values, float64, in C order (for ``diff``)."""

    dtype = np.dtype(np.float64)
    align = 0

    def __init__(self, encoding: BlockScaled, reader: TensorReader) -> None:
        self.codes = CodeSource(encoding, reader)
        self.parallel_safe = self.codes.parallel_safe
        self.encoding = encoding

    def stored_bytes(self, start: int, stop: int) -> int:
        """What reading elements ``[start, stop)`` reads: their codes and their bands' scales."""
        blocks = self.encoding.grid
        bands = int(blocks.band((stop - 1) // blocks.cols)) - int(blocks.band(start // blocks.cols)) + 1
        return (stop - start) // self.encoding.fmt.per_byte + bands * blocks.nbc * self.encoding.scales_itemsize

    def read(self, start: int, stop: int, out: np.ndarray | None) -> np.ndarray:
        encoding, blocks = self.encoding, self.encoding.grid
        cols = blocks.cols
        per_byte = encoding.fmt.per_byte
        count = stop - start
        result = out[:count * 8].view(np.float64) if out is not None and out.size >= count * 8 \
            else np.empty(count, np.float64)
        position = start
        while position < stop:
            row = position // cols
            if position % cols == 0 and stop - position >= cols:  # whole rows at once
                end = position + (stop - position) // cols * cols
            else:
                end = min(stop, (row + 1) * cols)
            lo, hi = position - position % per_byte, end + (-end) % per_byte
            data = self.codes.read(lo, hi, None)
            unit = self.codes.rows(data.codes, lo, hi, data)
            values = self.codes._values(unit, None, encoding.scheme.global_op, self.codes.global_value)
            result[position - start:end - start] = values.reshape(-1)[position - lo:end - lo]
            position = end
        return result
