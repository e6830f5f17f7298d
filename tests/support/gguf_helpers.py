"""A small GGUF writer for tests: valid files of any type and byte order, and hostile ones.

Written from the spec (ggml's docs/gguf.md), independently of tclip's parser and of
the ``gguf`` package, so the tests can build files the package cannot (big-endian
quantized blocks, unknown types) and break them on purpose (``raw`` fields).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

# GGUF metadata value types
UINT8, INT8, UINT16, INT16, UINT32, INT32, FLOAT32, BOOL, STRING, ARRAY, UINT64, INT64, FLOAT64 = range(13)
_CODES = {UINT8: "B", INT8: "b", UINT16: "H", INT16: "h", UINT32: "I", INT32: "i", FLOAT32: "f",
          BOOL: "?", UINT64: "Q", INT64: "q", FLOAT64: "d"}

# ggml types: (block values, block bytes, byte offsets of the f16 scale fields)
BLOCKS = {
    0: (1, 4, ()), 1: (1, 2, ()), 30: (1, 2, ()),
    2: (32, 18, (0,)), 3: (32, 20, (0, 2)), 6: (32, 22, (0,)), 7: (32, 24, (0, 2)), 8: (32, 34, (0,)),
    10: (256, 84, (80, 82)), 11: (256, 110, (108,)), 12: (256, 144, (0, 2)), 13: (256, 176, (0, 2)),
    14: (256, 210, (208,)), 16: (256, 66, (0,)),
}
TYPE_IDS = {"F32": 0, "F16": 1, "BF16": 30, "Q4_0": 2, "Q4_1": 3, "Q5_0": 6, "Q5_1": 7, "Q8_0": 8,
            "Q2_K": 10, "Q3_K": 11, "Q4_K": 12, "Q5_K": 13, "Q6_K": 14, "IQ2_XXS": 16}


@dataclass
class Array:
    """A metadata array value: element type and elements (nested arrays as Array)."""

    element_type: int
    values: list[Any]


@dataclass
class Tensor:
    """A tensor to write: NumPy-order shape, ggml type, its bytes (in the file's byte order).

    ``offset`` (relative to the data section) defaults to the next aligned position;
    ``dims`` overrides the stored dimensions (innermost first)."""

    name: str
    shape: tuple[int, ...]
    ggml_type: int
    data: bytes = b""
    offset: int | None = None
    dims: tuple[int, ...] | None = None
    n_dims: int | None = None


@dataclass
class GgufSpec:
    metadata: list[tuple[str, int, Any]] = field(default_factory=list)
    tensors: list[Tensor] = field(default_factory=list)
    version: int = 3
    order: str = "<"
    alignment: int = 32
    magic: bytes = b"GGUF"
    tensor_count: int | None = None  # override the counts in the header
    kv_count: int | None = None
    truncate: int | None = None  # cut the file to this many bytes


def string(text: str | bytes, order: str = "<") -> bytes:
    raw = text.encode() if isinstance(text, str) else text
    return struct.pack(order + "Q", len(raw)) + raw


def value(kind: int, item: Any, order: str = "<") -> bytes:
    if kind == STRING:
        return string(item, order)
    if kind == ARRAY:
        assert isinstance(item, Array)
        return (struct.pack(order + "IQ", item.element_type, len(item.values))
                + b"".join(value(item.element_type, v, order) for v in item.values))
    return struct.pack(order + _CODES[kind], item)


def gguf_bytes(spec: GgufSpec) -> bytes:
    o = spec.order
    head = [spec.magic, struct.pack(o + "I", spec.version),
            struct.pack(o + "Q", len(spec.tensors) if spec.tensor_count is None else spec.tensor_count),
            struct.pack(o + "Q", len(spec.metadata) if spec.kv_count is None else spec.kv_count)]
    for key, kind, item in spec.metadata:
        head.append(string(key, o) + struct.pack(o + "I", kind) + value(kind, item, o))
    data = bytearray()
    for tensor in spec.tensors:
        offset = tensor.offset
        if offset is None:
            data.extend(b"\0" * (-len(data) % spec.alignment))
            offset = len(data)
            data.extend(tensor.data)
        elif tensor.data:  # a given offset with no data only claims (hostile files)
            end = offset + len(tensor.data)
            if len(data) < end:
                data.extend(b"\0" * (end - len(data)))
            data[offset:end] = tensor.data
        dims = tensor.dims if tensor.dims is not None else tuple(reversed(tensor.shape))
        n_dims = len(dims) if tensor.n_dims is None else tensor.n_dims
        head.append(string(tensor.name, o) + struct.pack(o + "I", n_dims)
                    + struct.pack(f"{o}{len(dims)}Q", *dims) + struct.pack(o + "IQ", tensor.ggml_type, offset))
    header = b"".join(head)
    out = header + b"\0" * (-len(header) % spec.alignment) + bytes(data)
    return out if spec.truncate is None else out[:spec.truncate]


def write_gguf(path: Path, spec: GgufSpec) -> Path:
    path.write_bytes(gguf_bytes(spec))
    return path


def swap_block_fields(raw: bytes, ggml_type: int) -> bytes:
    """Little-endian blocks in the byte order of a big-endian file: f16 fields (and
    F32/F16/BF16 values) swapped, Q5_0/Q5_1's 32-bit qh reversed, byte arrays kept."""
    elements, nbytes, fields = BLOCKS[ggml_type]
    blocks = np.frombuffer(raw, np.uint8).reshape(-1, nbytes).copy()
    if ggml_type in (0, 1, 30):
        return blocks.reshape(-1, nbytes)[:, ::-1].tobytes()
    for at in fields:
        blocks[:, at:at + 2] = blocks[:, at:at + 2][:, ::-1]
    if ggml_type in (6, 7):
        qh = 2 if ggml_type == 6 else 4
        blocks[:, qh:qh + 4] = blocks[:, qh:qh + 4][:, ::-1]
    return blocks.tobytes()


def random_blocks(ggml_type: int, count: int, rng: np.random.Generator, d: float = 1e-3,
                  dmin: float = 5e-3) -> bytes:
    """Valid random blocks: random codes and sub-scales, f16 scales of about ``d`` (and ``dmin``)."""
    elements, nbytes, fields = BLOCKS[ggml_type]
    if ggml_type in (0, 1, 30):
        values = rng.standard_normal(count).astype(np.float32)
        if ggml_type == 0:
            return values.astype("<f4").tobytes()
        if ggml_type == 1:
            return values.astype("<f2").tobytes()
        return (values.view("<u4") >> 16).astype("<u2").tobytes()
    blocks = rng.integers(0, 256, size=(count, nbytes), dtype=np.uint8)
    for index, at in enumerate(fields):
        size = d if index == 0 else dmin
        scales = (rng.uniform(0.5, 1.0, count) * size * rng.choice([-1, 1], count)).astype("<f2")
        blocks[:, at:at + 2] = scales.view(np.uint8).reshape(count, 2)
    return blocks.tobytes()


# The GGUF files tests in several folders build (moved from tests/formats/gguf/test_gguf_format.py)

# Block scales giving values of about 0.02 (a real model's weights) in every type.
BLOCK_D = {"Q8_0": 3e-4, "Q4_0": 2.5e-3, "Q4_1": 2.5e-3, "Q5_0": 1.2e-3, "Q5_1": 1.2e-3, "Q2_K": 4e-4, "Q3_K": 4e-4,
           "Q4_K": 1.2e-4, "Q5_K": 6e-5 * 2, "Q6_K": 7e-5}


def blocks_for(type_name: str, rows: int, cols: int, rng: np.random.Generator, order: str = "<") -> bytes:
    """Random blocks whose values are of about the same size in every type (as a real model's
    tensors are): the K types' 6-bit sub-scales make their d smaller."""
    type_id = TYPE_IDS[type_name]
    elements = BLOCKS[type_id][0]
    d = BLOCK_D[type_name] if type_name in BLOCK_D else 1.0
    raw = random_blocks(type_id, rows * cols // elements, rng, d=d, dmin=d / 4)
    return swap_block_fields(raw, type_id) if order == ">" else raw


def split_set(folder: Path, count: int = 3, prefix: str = "llama-3-8b-Q4_K_M", rows: int = 6,
              cols: int = 512) -> dict[str, tuple[str, bytes]]:
    """A split set as llama.cpp's gguf-split writes it: PREFIX-0000N-of-0000M.gguf, split.* keys."""
    folder.mkdir(exist_ok=True)
    rng = np.random.default_rng(21)
    made = {}
    kinds = ["Q4_K", "Q8_0", "Q6_K", "F32"]
    for number in range(count):
        tensors = []
        for layer in range(2):
            kind = kinds[(number + layer) % len(kinds)]
            name = f"blk.{2 * number + layer}.ffn_down.weight"
            raw = blocks_for(kind, rows, cols, rng)
            tensors.append(Tensor(name, (rows, cols), TYPE_IDS[kind], raw))
            made[name] = (kind, raw)
        meta = [("split.no", UINT16, number), ("split.count", UINT16, count),
                ("split.tensors.count", INT32, 2 * count)]
        write_gguf(folder / f"{prefix}-{number + 1:05d}-of-{count:05d}.gguf", GgufSpec(metadata=meta, tensors=tensors))
    return made
