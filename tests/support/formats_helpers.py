"""Helpers for format tests: write files with the formats' own libraries, rewrite with tclip."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from safetensors import TensorSpec, serialize

from tclip.formats import create_writer, open_reader

# safetensors' own names for the dtypes its serializer takes
SAFETENSORS_LIB_DTYPES = {
    "float64": "float64", "float32": "float32", "float16": "float16", "bfloat16": "bfloat16",
    "float8_e4m3fn": "float8_e4m3fn", "float8_e5m2": "float8_e5m2", "int8": "int8", "int16": "int16",
    "int32": "int32", "int64": "int64", "uint8": "uint8", "uint16": "uint16", "uint32": "uint32",
    "uint64": "uint64", "bool": "bool",
}


def safetensors_bytes(tensors: dict[str, np.ndarray], metadata: dict[str, str] | None = None) -> bytes:
    """A safetensors file as the library itself serializes it (any dtype, float8 included)."""
    arrays = {k: np.ascontiguousarray(v) for k, v in tensors.items()}
    specs = {
        k: TensorSpec(dtype=SAFETENSORS_LIB_DTYPES[v.dtype.name], shape=list(v.shape),
                      data_ptr=v.ctypes.data, data_len=v.nbytes)
        for k, v in arrays.items()
    }
    return bytes(serialize(specs, metadata=metadata))


def rewrite(source: Path, target: Path, block_bytes: int = 64, **kwargs) -> None:
    """Copy a file through tclip's reader and writer in small blocks, without clipping."""
    with open_reader(source) as reader:
        writer = create_writer(target, reader, **kwargs)
        with writer:
            for name in reader.tensors:
                for index in writer.blocks(name, block_bytes):
                    writer.write(name, index, reader.read(name, index))
            writer.commit()


def read_all(path: Path) -> dict[str, np.ndarray]:
    with open_reader(path) as reader:
        return {name: reader.read(name) for name in reader.tensors}
