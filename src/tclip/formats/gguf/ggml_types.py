"""ggml's tensor types as a GGUF file names them: ids, names and block sizes.

What a GGUF header needs to know of a tensor's type (how many bytes its data takes, where
its blocks keep their scale fields); the blocks' arithmetic is :mod:`tclip.quant.ggml`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

@dataclass(frozen=True)
class GgmlType:
    """One of ggml's tensor types: ``block_elements`` values stored in ``block_bytes`` bytes.

    ``scale_fields`` are the (byte offset in the block, encoding) of the block's
    scale and minimum fields, for the NaN/Inf scan; encodings: ``f16``, ``f32``,
    ``e8m0`` (a power of two, 0xFF is NaN).
    """

    id: int
    name: str
    block_elements: int
    block_bytes: int
    scale_fields: tuple[tuple[int, str], ...] = ()


def _t(id_: int, name: str, elements: int, nbytes: int, *fields: tuple[int, str]) -> GgmlType:
    return GgmlType(id_, name, elements, nbytes, tuple(fields))


_F16 = "f16"
# ggml.h's enum ggml_type with the block sizes of ggml-common.h. Ids 4, 5, 31-33 and
# 36-38 were removed from ggml and never appear in valid files.
GGML_TYPES: dict[int, GgmlType] = {t.id: t for t in (
    _t(0, "F32", 1, 4),
    _t(1, "F16", 1, 2),
    _t(2, "Q4_0", 32, 18, (0, _F16)),
    _t(3, "Q4_1", 32, 20, (0, _F16), (2, _F16)),
    _t(6, "Q5_0", 32, 22, (0, _F16)),
    _t(7, "Q5_1", 32, 24, (0, _F16), (2, _F16)),
    _t(8, "Q8_0", 32, 34, (0, _F16)),
    _t(9, "Q8_1", 32, 36, (0, _F16), (2, _F16)),  # gguf-py's table still says 40 (float d, s)
    _t(10, "Q2_K", 256, 84, (80, _F16), (82, _F16)),
    _t(11, "Q3_K", 256, 110, (108, _F16)),
    _t(12, "Q4_K", 256, 144, (0, _F16), (2, _F16)),
    _t(13, "Q5_K", 256, 176, (0, _F16), (2, _F16)),
    _t(14, "Q6_K", 256, 210, (208, _F16)),
    _t(15, "Q8_K", 256, 292, (0, "f32")),
    _t(16, "IQ2_XXS", 256, 66, (0, _F16)),
    _t(17, "IQ2_XS", 256, 74, (0, _F16)),
    _t(18, "IQ3_XXS", 256, 98, (0, _F16)),
    _t(19, "IQ1_S", 256, 50, (0, _F16)),
    _t(20, "IQ4_NL", 32, 18, (0, _F16)),
    _t(21, "IQ3_S", 256, 110, (0, _F16)),
    _t(22, "IQ2_S", 256, 82, (0, _F16)),
    _t(23, "IQ4_XS", 256, 136, (0, _F16)),
    _t(24, "I8", 1, 1),
    _t(25, "I16", 1, 2),
    _t(26, "I32", 1, 4),
    _t(27, "I64", 1, 8),
    _t(28, "F64", 1, 8),
    _t(29, "IQ1_M", 256, 56),  # its f16 scale is spread over the sub-scale bits
    _t(30, "BF16", 1, 2),
    _t(34, "TQ1_0", 256, 54, (52, _F16)),
    _t(35, "TQ2_0", 256, 66, (64, _F16)),
    _t(39, "MXFP4", 32, 17, (0, "e8m0")),
    _t(40, "NVFP4", 64, 36),  # four UE4M3 scales; not scanned
    _t(41, "Q1_0", 128, 18, (0, _F16)),
    _t(42, "Q2_0", 64, 18, (0, _F16)),
)}

F32, F16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 = 0, 1, 2, 3, 6, 7, 8
Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, BF16 = 10, 11, 12, 13, 14, 30


def type_info(type_id: int) -> GgmlType | None:
    """The type with ggml id ``type_id``, or None for an id ggml does not define."""
    return GGML_TYPES.get(type_id)


def type_name(type_id: int) -> str:
    """ggml's name of a type id, or ``type <id>`` for an unknown one."""
    info = GGML_TYPES.get(type_id)
    return info.name if info is not None else f"type {type_id}"


def tensor_nbytes(type_id: int, shape: tuple[int, ...]) -> int:
    """Bytes of a tensor of ``shape`` (NumPy order: the last axis is ggml's rows).

    Raises:
        ValueError: the type is unknown, or the row length is not a whole number of blocks.
    """
    info = GGML_TYPES.get(type_id)
    if info is None:
        raise ValueError(f"unknown ggml type {type_id}")
    count = math.prod(shape)
    if count == 0:
        return 0
    row = shape[-1] if shape else 1
    if row % info.block_elements:
        raise ValueError(
            f"a row of {row} values is not a whole number of {info.name} blocks "
            f"({info.block_elements} values each)"
        )
    return count // info.block_elements * info.block_bytes
