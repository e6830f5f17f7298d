"""A toy tensor format for the tests: one module, registered, is all a format needs.

A ``.toy`` file is ``TOYTENSR``, a little-endian u32 tensor count, then per
tensor: u16 name length, the UTF-8 name, u8 rank, u32 per dimension, a u8 dtype
code (0 float32, 1 int8, 2 ggml Q8_0 blocks), and the raw little-endian data.

Two encodings prove the seam for quantized weights (``quant.contract.QuantEncoding``):

- a tensor named ``X.codes`` (int8) next to ``X.scale`` (one float32) is read as one
  *logical* tensor ``X`` of values ``codes * scale`` (codes plus a separate scale,
  read-only here: its reducer dequantizes each unit);
- a tensor of dtype code 2 is one stored tensor of Q8_0 blocks (34 bytes per 32
  values: a float16 scale and 32 int8 codes, as GGUF stores them) whose header shape
  is the logical shape: statistics in closed form (``quant.ggml.block_stats``),
  NaN/Inf scales found (``scan_scales``), rescaled by rewriting the block scales
  (``scale_blocks``) through the writer's raw bytes.
"""

from __future__ import annotations

import math
import os
import struct
from collections.abc import Collection
from pathlib import Path

import numpy as np

from tclip.core.kernels import UnitMoments, reduce_unit
from tclip.core.stats import UnitResult
from tclip.errors import FormatError
from tclip.formats.atomic import AtomicOutput
from tclip.formats.base import EncodingSummary, PositionalWriter, TensorInfo, TensorReader, read_region
from tclip.quant import ggml
from tclip.quant.codes import Findings, ScaleFindings
from tclip.quant.contract import QuantEncoding

NAME = "toy"
SUFFIXES = (".toy",)
MAGIC = b"TOYTENSR"
DTYPES = {0: np.dtype("<f4"), 1: np.dtype("i1")}
CODES = {dtype: code for code, dtype in DTYPES.items()}
Q8_CODE, Q8_0 = 2, 8  # the toy's dtype code, ggml's type id
Q8_BLOCK_BYTES, Q8_BLOCK = 34, 32


def sniff(head: bytes, size: int) -> bool:
    return head.startswith(MAGIC)


class ScaledCodes(QuantEncoding):
    """A logical float32 tensor stored as int8 codes times one float32 scale (read-only)."""

    def __init__(self, codes: str, scale: str, shape: tuple[int, ...]) -> None:
        self.parts = (codes, scale)
        self._summary = EncodingSummary("int8 xf32 tensor", "toy", ((codes, "codes", "int8", shape),
                                                                     (scale, "scales", "float32", (1,))),
                                        (), "none")

    @property
    def summary(self) -> EncodingSummary:
        return self._summary

    def source(self, reader: TensorReader, info: TensorInfo) -> "ScaledSource":
        return ScaledSource(reader, *self.parts)

    def reducer(self, reader: TensorReader, info: TensorInfo, factor=None) -> "ScaledReducer":
        return ScaledReducer(reader, *self.parts)

    def rescale(self, reader, writer, info, factor):
        raise ValueError("the toy's scaled codes are read-only")


class ScaledReducer:
    """The simplest reducer: dequantize each unit and reduce it as values."""

    dtype = np.dtype(np.float32)
    parallel_safe = True
    align = 0

    def __init__(self, reader: TensorReader, codes: str, scale: str) -> None:
        self.values = ScaledSource(reader, codes, scale)

    def read(self, start: int, stop: int, out: np.ndarray | None) -> np.ndarray:
        return self.values.read(start, stop, out)

    def reduce(self, data, grid, first, stop, stats, scratch):
        results = []
        for k in range(first, stop):
            lo, hi = grid.bounds(k)
            start = grid.bounds(first)[0]
            unit = data[lo - start:hi - start].reshape(grid.unit_shape(k))
            moments = UnitMoments() if stats.track_moments else None
            results.append(UnitResult(*reduce_unit(unit, scratch, stats.axes, stats.track_l1, moments), unit.size, moments))
        return results, None


class Q8Blocks(QuantEncoding):
    """One stored tensor of ggml Q8_0 blocks: one float16 scale per 32 values of a row."""

    def __init__(self, name: str, shape: tuple[int, ...]) -> None:
        self.name, self.shape = name, shape
        self.blocks = math.prod(shape) // Q8_BLOCK
        self._summary = EncodingSummary("Q8_0", "toy ggml blocks", ((name, "blocks", "uint8", (self.nbytes,)),),
                                        (name,), "any")

    @property
    def summary(self) -> EncodingSummary:
        return self._summary

    @property
    def nbytes(self) -> int:
        return self.blocks * Q8_BLOCK_BYTES

    def source(self, reader: TensorReader, info: TensorInfo) -> "Q8Values":
        return Q8Values(reader, self.name)

    def reducer(self, reader: TensorReader, info: TensorInfo, factor=None) -> "Q8Reducer":
        return Q8Reducer(reader, self, None if factor is None else float(factor))

    def rescale(self, reader, writer, info, factor):
        factor = float(np.asarray(factor))

        def job() -> int:
            raw = np.asarray(reader.read_part(self.name, 0, self.nbytes))
            writer.write_flat(self.name, 0, ggml.scale_blocks(Q8_0, raw, factor).data)
            return raw.nbytes
        return [(self.name, job)]


class Q8Values:
    dtype = np.dtype(np.float64)
    parallel_safe = True
    align = 0

    def __init__(self, reader: TensorReader, name: str) -> None:
        self.reader, self.name = reader, name

    def read(self, start: int, stop: int, out: np.ndarray | None) -> np.ndarray:
        first, last = start // Q8_BLOCK, -(-stop // Q8_BLOCK)
        raw = self.reader.read_part(self.name, first * Q8_BLOCK_BYTES, last * Q8_BLOCK_BYTES)
        values = ggml.dequantize(Q8_0, raw).astype(np.float64)
        return values[start - first * Q8_BLOCK:stop - first * Q8_BLOCK]


class Q8Reducer:
    """Statistics of whole blocks in closed form; units are whole rows of whole blocks."""

    dtype = np.dtype(np.uint8)
    parallel_safe = True
    align = 0

    def __init__(self, reader: TensorReader, encoding: Q8Blocks, factor: float | None) -> None:
        self.reader, self.encoding, self.factor = reader, encoding, factor

    def read(self, start: int, stop: int, out: np.ndarray | None):
        raw = np.asarray(self.reader.read_part(self.encoding.name, start // Q8_BLOCK * Q8_BLOCK_BYTES,
                                               stop // Q8_BLOCK * Q8_BLOCK_BYTES))
        if self.factor is not None:  # as the rescale writes it
            raw = ggml.scale_blocks(Q8_0, raw, self.factor).data
        return raw

    def reduce(self, raw, grid, first, stop, stats, scratch):
        start = grid.bounds(first)[0]
        findings = Findings(self.encoding.name, self.encoding.shape) if self.factor is None else None
        results = []
        for k in range(first, stop):
            lo, hi = grid.bounds(k)
            part = raw[(lo - start) // Q8_BLOCK * Q8_BLOCK_BYTES:(hi - start) // Q8_BLOCK * Q8_BLOCK_BYTES]
            if stats.axes is not None or stats.track_l1 or stats.track_moments:  # as values, the slow road
                values = ggml.dequantize(Q8_0, part).astype(np.float64).reshape(grid.unit_shape(k))
                moments = UnitMoments() if stats.track_moments else None
                results.append(UnitResult(*reduce_unit(values, scratch, stats.axes, stats.track_l1, moments), values.size,
                                moments))
            else:
                s = ggml.block_stats(Q8_0, part, group_blocks=(hi - lo) // Q8_BLOCK)
                results.append(UnitResult(float(s.sum_of_squares[0]), float(s.minimum[0]), float(s.maximum[0]),
                                int(s.nan_count[0]), int(s.inf_count[0]), 0.0, hi - lo, None))
            if findings is not None:  # each unit's own blocks: every scale counted once
                found = findings.scales.setdefault(self.encoding.name, ScaleFindings(
                    self.encoding.name, (self.encoding.blocks,)))
                blocks = np.asarray(part, np.uint8).reshape(-1, Q8_BLOCK_BYTES)
                found.add(np.ascontiguousarray(blocks[:, :2]).view("<f2").astype(np.float64).reshape(-1),
                          lo // Q8_BLOCK)
        return results, findings


class ScaledSource:
    dtype = np.dtype(np.float32)
    parallel_safe = True
    align = 0

    def __init__(self, reader: TensorReader, codes: str, scale: str) -> None:
        self.reader, self.codes = reader, codes
        self.scale = np.float32(reader.read_flat(scale, 0, 1)[0])

    def read(self, start: int, stop: int, out: np.ndarray | None) -> np.ndarray:
        values = self.reader.read_flat(self.codes, start, stop).astype(np.float32) * self.scale
        result = out[: values.nbytes].view(np.float32) if out is not None and out.size >= values.nbytes \
            else np.empty(values.size, np.float32)
        result[...] = values
        return result


def header(tensors: list[TensorInfo]) -> bytes:
    parts = [MAGIC, struct.pack("<I", len(tensors))]
    for info in tensors:
        name = info.name.encode("utf-8")
        code = Q8_CODE if isinstance(info.encoding, Q8Blocks) else CODES[info.dtype]
        parts += [struct.pack("<H", len(name)), name, struct.pack("<B", len(info.shape)),
                  struct.pack(f"<{len(info.shape)}I", *info.shape), struct.pack("<B", code)]
    return b"".join(parts)


class ToyReader(TensorReader):
    format_name = NAME

    def __init__(self, path: Path) -> None:
        super().__init__(path)
        self._file = open(path, "rb")
        try:
            self.offsets: dict[str, int] = {}
            stored: dict[str, TensorInfo] = {}
            data = self._file.read()
            if not data.startswith(MAGIC):
                raise FormatError("not a toy file", path)
            (count,) = struct.unpack_from("<I", data, 8)
            position, infos = 12, []
            for _ in range(count):
                (length,) = struct.unpack_from("<H", data, position)
                name = data[position + 2:position + 2 + length].decode("utf-8")
                position += 2 + length
                (rank,) = struct.unpack_from("<B", data, position)
                shape = struct.unpack_from(f"<{rank}I", data, position + 1)
                (code,) = struct.unpack_from("<B", data, position + 1 + 4 * rank)
                position += 2 + 4 * rank
                if code == Q8_CODE:  # the header's shape is the logical one; its rows are whole blocks
                    infos.append(TensorInfo(name, tuple(shape), np.dtype(np.float16),
                                            dtype_label="Q8_0", encoding=Q8Blocks(name, tuple(shape))))
                else:
                    infos.append(TensorInfo(name, tuple(shape), DTYPES[code]))
            for info in infos:
                self.offsets[info.name] = position
                position += info.nbytes
                stored[info.name] = info
            if position != os.fstat(self._file.fileno()).st_size:
                raise FormatError("the data does not fill the file", path)
            for name, info in stored.items():
                base = name[: -len(".codes")]
                if name.endswith(".codes") and f"{base}.scale" in stored:
                    self.tensors[base] = TensorInfo(base, info.shape, np.dtype(np.float32),
                                                    encoding=ScaledCodes(name, f"{base}.scale", info.shape))
                elif not (name.endswith(".scale") and f"{name[:-len('.scale')]}.codes" in stored):
                    self.tensors[name] = info
            self.stored = stored
        except BaseException:
            self._file.close()  # a reader that cannot open leaves nothing open
            raise

    def region(self, name: str) -> tuple[int, int] | None:
        return (self._file.fileno(), self.offsets[name]) if name in self.offsets else None

    def read_part(self, name: str, start: int, stop: int, out: np.ndarray | None = None) -> np.ndarray:
        info = self.stored[name]
        if info.encoding is not None:  # raw bytes of the blocks
            return np.frombuffer(os.pread(self._file.fileno(), stop - start, self.offsets[name] + start), np.uint8)
        return self.read_flat(name, start, stop, out)

    def read_flat(self, name: str, start: int, stop: int, out: np.ndarray | None = None) -> np.ndarray:
        if name in self.tensors and self.tensors[name].encoding is not None:
            # Only its encoding's source reads a logical tensor (what the test of the seam relies on).
            raise TypeError(f"{name!r} is a logical tensor: read it through its encoding")
        if name not in self.tensors:  # a stored part of a logical tensor
            info = self.stored[name]
            raw = os.pread(self._file.fileno(), (stop - start) * info.dtype.itemsize,
                           self.offsets[name] + start * info.dtype.itemsize)
            return np.frombuffer(raw, info.dtype).copy()
        return super().read_flat(name, start, stop, out)

    def read(self, name: str, index=None, scratch=None) -> np.ndarray:
        return read_region(self, name, index)

    def close(self) -> None:
        self._file.close()


class ToyWriter(PositionalWriter):
    format_name = NAME

    def __init__(self, target: Path, tensors: list[TensorInfo], output: AtomicOutput, *,
                 like: TensorReader | None, metadata: dict[str, str] | None,
                 rewritten: Collection[str] | None) -> None:
        plain = [t if isinstance(t.encoding, Q8Blocks) else TensorInfo(t.name, t.shape, t.dtype) for t in tensors]
        super().__init__(target, plain, output)
        head = header(plain)
        position = len(head)
        for info in plain:
            self.offsets[info.name] = position
            position += info.nbytes
        self._open(head, position)


Reader = ToyReader
Writer = ToyWriter


def write(path: Path, tensors: dict[str, np.ndarray], q8: dict[str, tuple[tuple[int, ...], bytes]] | None = None
          ) -> None:
    """A .toy file of ``tensors`` (float32 or int8) and ``q8`` (name: logical shape, Q8_0 block
    bytes), written directly (not through tclip)."""
    infos = [TensorInfo(name, tuple(array.shape), np.dtype(array.dtype).newbyteorder("<")) for name, array in
             tensors.items()]
    infos += [TensorInfo(name, shape, np.dtype(np.float16), encoding=Q8Blocks(name, shape))
              for name, (shape, _) in (q8 or {}).items()]
    with open(path, "wb") as handle:
        handle.write(header(infos))
        for array in tensors.values():
            handle.write(np.ascontiguousarray(array).astype(np.dtype(array.dtype).newbyteorder("<")).tobytes())
        for _, blocks in (q8 or {}).values():
            handle.write(blocks)


def read(path: Path) -> dict[str, np.ndarray]:
    with ToyReader(path) as reader:
        return {name: reader.read_flat(name, 0, info.size).reshape(info.shape)
                for name, info in reader.tensors.items() if info.encoding is None}
