"""Which stored tensors of a checkpoint are one quantized weight, and how to read it.

A quantized checkpoint stores each weight as codes plus scale tensors, possibly in
different shards of one set. :func:`detect` reads the headers of every file of a
set (names, dtypes, shapes) and the quantization config beside them
(``config.json``'s ``quantization_config``, ``hf_quant_config.json``), and returns
a :class:`QuantLayout`: plain data naming, for each weight, its parts and the file
of each part, its scheme (code format, block shape, how the scales combine), the
file whose passes measure and rewrite it, and activation scales (``input_scale``,
``k_scale``...) that are no weights at all.

The tensor names, dtypes and shapes decide; the config confirms them and gives
what shapes cannot (a block size, power-of-two scales). Conventions (README,
"Quantized checkpoints"):

==========================  ======================================  ==============================
weight (logical name)       parts                                   real value
==========================  ======================================  ==============================
``X.weight`` F8             ``X.weight_scale_inv`` [ceil(R/b),..]   code * scale (per block)
``X.weight`` F8 / I8        ``X.weight_scale`` [], [1], [R,1]...    code * scale (broadcast)
``X.weight`` U8 (NVFP4)     ``X.weight_scale`` F8 [R,C/16],         e2m1 * scale * scale_2
                            ``X.weight_scale_2`` F32 []
``X.weight`` (packed U8)    ``X.weight_packed`` U8, ``X.weight_     e2m1 * scale / global_scale
                            scale`` F8, ``X.weight_global_scale``
``X.weight`` (packed U8)    ``X.weight_packed`` U8, ``X.weight_     e2m1 * 2**(byte - 127)
                            scale`` U8/F8_E8M0 [R, C/32]
``X`` (gpt-oss)             ``X_blocks`` U8 [..,G,16], ``X_scales``  e2m1 * 2**(byte - 127)
==========================  ======================================  ==============================

Anything that looks quantized but does not fit (integer packed codes, zero points,
GPTQ/AWQ tensors, a scale whose shape fits no block) becomes a weight with a
``problem``: never measured, never clipped, shown with the reason.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ..core.dtypes import is_floating
from ..formats.base import TensorInfo

# Activation and KV-cache scales: no weight's part, never a weight themselves.
ACTIVATION_SUFFIXES = (".input_scale", ".input_global_scale", ".input_zero_point", ".output_scale",
                       ".output_zero_point", ".k_scale", ".v_scale", ".q_scale", ".prob_scale",
                       ".k_zero_point", ".v_zero_point", ".pre_quant_scale")
# Parts a quantized weight may have besides its codes, by the suffix they add to ``X.weight``.
SCALE_SUFFIXES = ("_scale_inv", "_scale_2", "_global_scale", "_scale", "_zero_point", "_shape", "_g_idx")
CONFIG_NAMES = ("config.json", "hf_quant_config.json")
MAX_CONFIG_BYTES = 16 << 20

_CODE_DTYPES = {"float8_e4m3fn": "e4m3fn", "float8_e5m2": "e5m2", "float8_e4m3fnuz": "e4m3fnuz",
                "float8_e5m2fnuz": "e5m2fnuz", "int8": "int8"}


@dataclass(frozen=True)
class Part:
    """One stored tensor of a quantized weight: its name, its file and its role
    (``codes``, ``scales``, ``global scale``, or for what is not understood ``part``)."""

    name: str
    file: str
    role: str
    dtype: str
    shape: tuple[int, ...]


@dataclass(frozen=True)
class Scheme:
    """How a weight's real values come from its parts (see :mod:`tclip.quant.codes`).

    ``codes``: the code format; ``block``: (rows, columns) per scale; ``e8m0``: the
    block scales are E8M0 bytes; ``global_op``: ``"multiply"``, ``"divide"`` or None;
    ``convention``: who writes it this way (for people); ``label``: the short form.
    ``power_of_two``: the config says the scales are powers of two (``scale_fmt: ue8m0``).
    """

    codes: str
    block: tuple[int, int]
    e8m0: bool = False
    global_op: str | None = None
    convention: str = ""
    label: str = ""
    power_of_two: bool = False


@dataclass(frozen=True)
class QuantWeight:
    """A logical weight: ``shape`` is the real weight's; ``parts`` codes first.

    ``owner`` is the file whose passes measure and rewrite it: the one holding the
    part a rescale rewrites (the global scale if there is one, else the block scales).
    ``problem``: recognised as quantized but not understood (why); ``scheme`` is then None.
    """

    name: str
    shape: tuple[int, ...]
    parts: tuple[Part, ...]
    owner: str
    scheme: Scheme | None = None
    problem: str | None = None

    @property
    def codes(self) -> Part:
        return self.parts[0]

    def part(self, role: str) -> Part | None:
        return next((p for p in self.parts if p.role == role), None)

    @property
    def rescaled(self) -> Part | None:
        """The part a rescale rewrites."""
        if self.scheme is None:
            return None
        return self.part("global scale") if self.scheme.global_op else self.part("scales")


@dataclass
class QuantLayout:
    """The quantized weights of a file or set, and what is no weight (plain, picklable)."""

    weights: dict[str, QuantWeight] = field(default_factory=dict)
    part_of: dict[str, str] = field(default_factory=dict)   # stored name -> logical name
    activation: frozenset[str] = frozenset()
    convention: str | None = None                            # from the config, for people

    def __bool__(self) -> bool:
        return bool(self.weights or self.activation)

    def owned_by(self, file: str) -> list[str]:
        return [w.name for w in self.weights.values() if w.owner == file]

    def files_needed(self, file: str) -> set[str]:
        """Other files whose parts the weights owned by ``file`` read."""
        return {p.file for w in self.weights.values() if w.owner == file for p in w.parts} - {file}


# --------------------------------------------------------------------------- config files


def read_configs(folder: Path) -> dict[str, Any]:
    """``quantization_config`` of ``config.json`` and ``quantization`` of ``hf_quant_config.json``
    in ``folder`` (missing, unreadable or malformed files count as absent: they are hints)."""
    found: dict[str, Any] = {}
    for name in CONFIG_NAMES:
        path = Path(folder) / name
        try:
            if not path.is_file() or path.stat().st_size > MAX_CONFIG_BYTES:
                continue
            data = json.loads(path.read_bytes().decode("utf-8"))
        except (OSError, UnicodeDecodeError, ValueError, RecursionError):
            continue
        if not isinstance(data, dict):
            continue
        if name == "config.json" and isinstance(data.get("quantization_config"), dict):
            found["quantization_config"] = data["quantization_config"]
        elif name == "hf_quant_config.json" and isinstance(data.get("quantization"), dict):
            found["hf_quant_config"] = data["quantization"]
    return found


@dataclass(frozen=True)
class _Config:
    """What the config says, reduced to what detection uses."""

    method: str | None = None          # fp8, compressed-tensors, modelopt, mxfp4, gptq, ...
    block: tuple[int, int] | None = None
    group_size: int | None = None
    strategy: str | None = None
    ct_format: str | None = None
    algo: str | None = None            # ModelOpt quant_algo
    power_of_two: bool = False

    @property
    def label(self) -> str | None:
        if self.method is None:
            return None
        parts = [self.method]
        if self.algo:
            parts.append(self.algo)
        if self.ct_format:
            parts.append(self.ct_format)
        if self.strategy:
            parts.append(self.strategy)
        return " ".join(parts)


def _parse_config(configs: dict[str, Any]) -> _Config:
    hf = configs.get("hf_quant_config")
    qc = configs.get("quantization_config") or {}
    if isinstance(hf, dict) and hf.get("quant_algo"):
        return _Config("modelopt", algo=str(hf.get("quant_algo")).upper(), group_size=_int(hf.get("group_size")))
    method = str(qc.get("quant_method", "")).lower() or None
    if method is None:
        return _Config()
    if method.startswith("modelopt"):
        return _Config("modelopt", algo=str(qc.get("quant_algo", "")).upper() or None)
    if method == "fp8":
        block = qc.get("weight_block_size")
        size = (int(block[0]), int(block[1])) if isinstance(block, list) and len(block) == 2 \
            and all(isinstance(b, int) and b > 0 for b in block) else None
        return _Config("fp8", block=size, power_of_two=str(qc.get("scale_fmt", "")).lower() == "ue8m0")
    if method == "compressed-tensors":
        groups = qc.get("config_groups") or {}
        weights = {}
        ct_format = qc.get("format")
        if isinstance(groups, dict):
            for group in groups.values():
                if isinstance(group, dict) and isinstance(group.get("weights"), dict):
                    weights = group["weights"]
                    ct_format = group.get("format") or ct_format
                    break
        block = weights.get("block_structure")
        size = (int(block[0]), int(block[1])) if isinstance(block, list) and len(block) == 2 \
            and all(isinstance(b, int) and b > 0 for b in block) else None
        return _Config("compressed-tensors", block=size, group_size=_int(weights.get("group_size")),
                       strategy=weights.get("strategy") if isinstance(weights.get("strategy"), str) else None,
                       ct_format=ct_format if isinstance(ct_format, str) else None)
    return _Config(method)


def _int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


# --------------------------------------------------------------------------- detection


def detect(headers: dict[str, list[TensorInfo]], configs: dict[str, Any] | None = None) -> QuantLayout:
    """The quantized weights among ``headers`` (file -> its stored tensors, in file order).

    Args:
        headers: every file of the set with its stored tensors' infos.
        configs: what :func:`read_configs` found beside them.

    Returns:
        A :class:`QuantLayout` (empty when nothing is quantized).
    """
    config = _parse_config(configs or {})
    where: dict[str, tuple[str, TensorInfo]] = {}
    for file, infos in headers.items():
        for info in infos:
            where.setdefault(info.name, (file, info))
    layout = QuantLayout(convention=config.label)
    taken: set[str] = set()

    def add(weight: QuantWeight) -> None:
        if any(p.name in taken for p in weight.parts):
            return
        if weight.name in where and weight.name not in {p.name for p in weight.parts}:
            weight = QuantWeight(weight.codes.name, weight.shape, weight.parts, weight.owner, weight.scheme,
                                 weight.problem)  # a plain tensor has the name: keep the codes' own
        layout.weights[weight.name] = weight
        for p in weight.parts:
            layout.part_of[p.name] = weight.name
            taken.add(p.name)

    for name in sorted(where):
        file, info = where[name]
        weight = _weight_at(name, info, file, where, config)
        if weight is not None:
            add(weight)
    if config.method is not None:  # a quantized checkpoint: codes or scales whose other half is missing
        for name in sorted(where):
            if name not in taken:
                orphan = _orphan(name, where, config)
                if orphan is not None:
                    add(orphan)
    activation = set()
    if layout.weights or config.method is not None:
        activation = {n for n in where if n.endswith(ACTIVATION_SUFFIXES) and n not in taken}
    layout.activation = frozenset(activation)
    return layout


def _part(where: dict[str, tuple[str, TensorInfo]], name: str, role: str) -> Part:
    file, info = where[name]
    return Part(name, file, role, _dtype_text(info.dtype), tuple(info.shape))


def _dtype_text(dtype: np.dtype) -> str:
    return np.dtype(dtype).name


def _weight_at(name: str, info: TensorInfo, file: str, where: dict[str, tuple[str, TensorInfo]],
               config: _Config) -> QuantWeight | None:
    """The quantized weight whose codes are the stored tensor ``name``, if it is one."""
    if name.endswith("_blocks") and name[:-len("_blocks")] + "_scales" in where:
        return _mx_blocks(name[:-len("_blocks")], "_blocks", "_scales", where)
    if name.endswith(".blocks") and name[:-len(".blocks")] + ".scales" in where:
        return _mx_blocks(name[:-len(".blocks")], ".blocks", ".scales", where)
    if name.endswith(".weight_packed") or name.endswith(".weight"):
        stem = name[:-len("_packed")] if name.endswith("_packed") else name
        companions = {s: stem + s for s in SCALE_SUFFIXES if stem + s in where}
        if name.endswith(".weight_packed"):
            return _packed(stem, name, companions, where, config)
        if not companions:
            return None
        return _codes_and_scales(stem, companions, where, config)
    if name.endswith(".qweight") and config.method in (None, "gptq", "awq"):
        stem = name[:-len("qweight")]
        parts = [n for n in (name, stem + "qzeros", stem + "scales", stem + "g_idx") if n in where]
        if len(parts) > 1:
            return _not_understood(stem + "weight", parts, where, f"{config.method or 'GPTQ/AWQ'} packed integer "
                                   "weights are not understood")
    if name.endswith("_scales_inv") and name[:-len("_scales_inv")] in where:  # HF fused experts (FP8)
        stem = name[:-len("_scales_inv")]
        codes_file, codes = where[stem]
        if _code_format(codes.dtype) is not None:
            return _scaled(stem, stem, name, "scales", where, config, "Hugging Face fused-expert fp8")
    return None


_SCALE_ENDINGS = ("weight_scale_inv", "weight_scale_2", "weight_global_scale", "weight_scale", "weight_zero_point",
                  "_scales_inv")


def _orphan(name: str, where: dict[str, tuple[str, TensorInfo]], config: _Config) -> QuantWeight | None:
    """In a quantized checkpoint, codes without their scales or scales without their codes
    (one shard of a set opened alone): never to be measured or clipped as plain values."""
    dtype = np.dtype(where[name][1].dtype)
    if name.endswith((".weight_packed", "_blocks")) and dtype == np.uint8 or name.endswith(".weight") and (
            _code_format(dtype) is not None or dtype == np.uint8 and config.method == "modelopt"):
        missing = "its scales are"
    elif name.endswith(_SCALE_ENDINGS) and is_floating(dtype) or name.endswith(("_scales", ".scales")) \
            and dtype == np.uint8:
        missing = "its codes are"
    else:
        return None
    return _not_understood(name, [name], where, f"{missing} not in this file of a {config.label} checkpoint; give "
                           "the whole set, its index")


def _not_understood(logical: str, names: Iterable[str], where: dict[str, tuple[str, TensorInfo]],
                    problem: str) -> QuantWeight:
    names = list(names)
    parts = tuple(_part(where, n, "codes" if i == 0 else "part") for i, n in enumerate(names))
    shape = tuple(where[names[0]][1].shape)
    return QuantWeight(logical, shape, parts, parts[0].file, None, problem)


def _code_format(dtype: np.dtype) -> str | None:
    return _CODE_DTYPES.get(np.dtype(dtype).name)


def _codes_and_scales(stem: str, companions: dict[str, str], where: dict[str, tuple[str, TensorInfo]],
                      config: _Config) -> QuantWeight | None:
    """``X.weight`` with ``X.weight_scale_inv`` / ``X.weight_scale`` (+ ``_scale_2``)."""
    codes_file, codes = where[stem]
    dtype = np.dtype(codes.dtype)
    if "_zero_point" in companions or "_g_idx" in companions:
        if _code_format(dtype) is None and dtype != np.uint8:
            return None
        return _not_understood(stem, [stem, *companions.values()], where,
                               "asymmetric codes (a zero point) or reordered groups are not understood")
    if dtype == np.uint8 and "_scale" in companions and "_scale_2" in companions:
        return _nvfp4(stem, stem, companions["_scale"], companions["_scale_2"], "multiply", where,
                      "ModelOpt NVFP4")
    if _code_format(dtype) is None:
        if dtype == np.uint8 and "_scale" in companions:
            return _not_understood(stem, [stem, *companions.values()], where,
                                   "uint8 codes with this scale layout are not understood")
        return None  # a plain weight that happens to have a *_scale neighbour
    if "_scale_inv" in companions:
        return _scaled(stem, stem, companions["_scale_inv"], "scales", where, config, "fp8 block (DeepSeek)")
    if "_scale" in companions:
        if "_scale_2" in companions or "_global_scale" in companions:
            return _not_understood(stem, [stem, *companions.values()], where,
                                   "8-bit codes with a second-level scale are not understood")
        convention = "ModelOpt fp8" if config.method == "modelopt" else \
            "compressed-tensors float-quantized" if config.method == "compressed-tensors" else "fp8 with scales"
        return _scaled(stem, stem, companions["_scale"], "scales", where, config, convention)
    return _not_understood(stem, [stem, *companions.values()], where,
                           "8-bit codes without a scale tensor tclip knows")


def _packed(stem: str, name: str, companions: dict[str, str], where: dict[str, tuple[str, TensorInfo]],
            config: _Config) -> QuantWeight:
    """compressed-tensors ``X.weight_packed``."""
    codes = where[name][1]
    scale = companions.get("_scale")
    if np.dtype(codes.dtype) != np.uint8 or scale is None or "_zero_point" in companions \
            or "_g_idx" in companions:
        kind = "integer" if np.dtype(codes.dtype) != np.uint8 else "packed"
        return _not_understood(stem, [name, *companions.values()], where,
                               f"compressed-tensors {kind} codes ({_dtype_text(codes.dtype)}"
                               f"{', a zero point' if '_zero_point' in companions else ''}) are not understood")
    scale_dtype = np.dtype(where[scale][1].dtype)
    if "_global_scale" in companions:
        return _nvfp4(stem, name, scale, companions["_global_scale"], "divide", where, "compressed-tensors NVFP4")
    if scale_dtype == np.uint8 or scale_dtype.name == "float8_e8m0fnu":
        return _mx(stem, name, scale, where, "compressed-tensors MXFP4", 32)
    return _not_understood(stem, [name, *companions.values()], where,
                           f"packed codes with {_dtype_text(scale_dtype)} scales and no global scale are not "
                           "understood")


def _fit(shape: tuple[int, ...], scale_shape: tuple[int, ...], hint: tuple[int | None, int | None]
         ) -> tuple[int, int] | str:
    """The (rows, columns) of a block for a weight of ``shape`` whose scales have ``scale_shape``,
    or why none fits. ``hint``: what the config says, None where it says nothing."""
    rows, cols = shape[-2], shape[-1]
    lead = shape[:-2]
    size = math.prod(scale_shape)
    if size == 1 and not lead:
        return rows, cols
    if len(scale_shape) == 4 and scale_shape[1] == scale_shape[3] == 1 and not lead:  # ModelOpt [ob, 1, ib, 1]
        scale_shape = (scale_shape[0], scale_shape[2])
    if tuple(scale_shape) in (shape[:-1], shape[:-1] + (1,)):
        return 1, cols  # one scale per row
    if len(scale_shape) != len(shape) or tuple(scale_shape[:-2]) != lead:
        return f"scale shape {list(scale_shape)} fits no block layout of a weight of shape {list(shape)}"
    out = []
    for n, count, want in ((rows, scale_shape[-2], hint[0]), (cols, scale_shape[-1], hint[1])):
        if want is not None:
            if -(-n // want) != count:
                return (f"scale shape {list(scale_shape)} does not fit blocks of {hint[0] or '?'}x{hint[1] or '?'} "
                        f"of a weight of shape {list(shape)}")
            out.append(want)
        elif count == n:
            out.append(1)
        elif count == 1:
            out.append(n)
        elif -(-n // 128) == count:
            out.append(128)
        elif n % count == 0:
            out.append(n // count)
        else:
            return f"scale shape {list(scale_shape)} fits no block layout of a weight of shape {list(shape)}"
    return out[0], out[1]


def _granularity(shape: tuple[int, ...], block: tuple[int, int]) -> str:
    rows, cols = shape[-2], shape[-1]
    if block == (rows, cols):
        return "tensor"
    if block == (1, cols):
        return "row"
    if block[0] == 1:
        return f"1x{block[1]}"
    return f"{block[0]}x{block[1]}"


def _scaled(logical: str, codes_name: str, scale_name: str, role: str, where: dict[str, tuple[str, TensorInfo]],
            config: _Config, convention: str) -> QuantWeight:
    codes_file, codes = where[codes_name]
    scale_file, scale = where[scale_name]
    fmt = _code_format(codes.dtype)
    shape = tuple(codes.shape)
    names = [codes_name, scale_name]
    if fmt is None or len(shape) < 2:
        return _not_understood(logical, names, where, f"codes of dtype {_dtype_text(codes.dtype)} and rank "
                               f"{len(shape)} are not understood")
    if not is_floating(scale.dtype):
        return _not_understood(logical, names, where, f"scales of dtype {_dtype_text(scale.dtype)} are not "
                               "understood")
    hint: tuple[int | None, int | None] = (None, None)
    if config.block is not None and config.method in ("fp8", "compressed-tensors") \
            and (config.method == "fp8" or config.strategy == "block"):
        hint = config.block
    elif config.method == "compressed-tensors" and config.strategy == "group" and config.group_size:
        hint = (1, config.group_size)
    block = _fit(shape, tuple(scale.shape), hint)
    if isinstance(block, str):
        return _not_understood(logical, names, where, block)
    parts = (Part(codes_name, codes_file, "codes", _dtype_text(codes.dtype), shape),
             Part(scale_name, scale_file, role, _dtype_text(scale.dtype), tuple(scale.shape)))
    label = f"{CODE_LABELS[fmt]} x{_short(scale.dtype)} {_granularity(shape, block)}"
    scheme = Scheme(fmt, block, convention=convention, label=label, power_of_two=config.power_of_two)
    return QuantWeight(logical, shape, parts, scale_file, scheme)


CODE_LABELS = {"e4m3fn": "e4m3", "e5m2": "e5m2", "e4m3fnuz": "e4m3fnuz", "e5m2fnuz": "e5m2fnuz", "int8": "int8",
               "e2m1": "fp4"}


def _short(dtype: np.dtype) -> str:
    name = np.dtype(dtype).name
    return {"float32": "f32", "float16": "f16", "bfloat16": "bf16", "float64": "f64",
            "float8_e4m3fn": "e4m3", "float8_e8m0fnu": "e8m0", "uint8": "e8m0"}.get(name, name)


def _nvfp4(logical: str, codes_name: str, scale_name: str, global_name: str, op: str,
           where: dict[str, tuple[str, TensorInfo]], convention: str) -> QuantWeight:
    codes_file, codes = where[codes_name]
    scale_file, scale = where[scale_name]
    global_file, global_scale = where[global_name]
    names = [codes_name, scale_name, global_name]
    shape = tuple(codes.shape[:-1]) + (2 * codes.shape[-1],) if codes.shape else ()
    if len(shape) < 2 or np.dtype(codes.dtype) != np.uint8:
        return _not_understood(logical, names, where, f"packed codes of shape {list(codes.shape)} are not understood")
    if np.dtype(scale.dtype).name != "float8_e4m3fn":
        return _not_understood(logical, names, where, f"NVFP4 block scales of dtype {_dtype_text(scale.dtype)} are "
                               "not understood (expected float8_e4m3fn)")
    if not is_floating(global_scale.dtype) or math.prod(global_scale.shape) != 1:
        return _not_understood(logical, names, where, f"a global scale of shape {list(global_scale.shape)} and dtype "
                               f"{_dtype_text(global_scale.dtype)} is not understood (expected one float)")
    block = _fit(shape, tuple(scale.shape), (1, 16))
    if isinstance(block, str):
        return _not_understood(logical, names, where, block)
    parts = (Part(codes_name, codes_file, "codes", "uint8", tuple(codes.shape)),
             Part(scale_name, scale_file, "scales", _dtype_text(scale.dtype), tuple(scale.shape)),
             Part(global_name, global_file, "global scale", _dtype_text(global_scale.dtype),
                  tuple(global_scale.shape)))
    label = f"nvfp4 x{_short(scale.dtype)} 1x16 {'x' if op == 'multiply' else '/'}{_short(global_scale.dtype)}"
    return QuantWeight(logical, shape, parts, global_file, Scheme("e2m1", block, False, op, convention, label))


def _mx(logical: str, codes_name: str, scale_name: str, where: dict[str, tuple[str, TensorInfo]],
        convention: str, group: int, shape: tuple[int, ...] | None = None) -> QuantWeight:
    codes_file, codes = where[codes_name]
    scale_file, scale = where[scale_name]
    names = [codes_name, scale_name]
    if shape is None:
        shape = tuple(codes.shape[:-1]) + (2 * codes.shape[-1],) if codes.shape else ()
    if len(shape) < 2 or np.dtype(codes.dtype) != np.uint8:
        return _not_understood(logical, names, where, f"packed codes of shape {list(codes.shape)} are not understood")
    block = _fit(shape, tuple(scale.shape), (1, group))
    if isinstance(block, str):
        return _not_understood(logical, names, where, block)
    parts = (Part(codes_name, codes_file, "codes", "uint8", tuple(codes.shape)),
             Part(scale_name, scale_file, "scales", _dtype_text(scale.dtype), tuple(scale.shape)))
    scheme = Scheme("e2m1", block, True, None, convention, f"mxfp4 xe8m0 1x{block[1]}")
    return QuantWeight(logical, shape, parts, scale_file, scheme)


def _mx_blocks(stem: str, blocks_suffix: str, scales_suffix: str,
               where: dict[str, tuple[str, TensorInfo]]) -> QuantWeight:
    """gpt-oss: ``X_blocks`` U8 [..., G, 16] and ``X_scales`` U8 [..., G]: the real weight [..., G * 32]."""
    codes_name, scale_name = stem + blocks_suffix, stem + scales_suffix
    codes = where[codes_name][1]
    if np.dtype(codes.dtype) != np.uint8 or len(codes.shape) < 3:
        return _not_understood(stem, [codes_name, scale_name], where,
                               f"MX blocks of dtype {_dtype_text(codes.dtype)} and shape {list(codes.shape)} are "
                               "not understood")
    groups, per = codes.shape[-2], codes.shape[-1]
    shape = tuple(codes.shape[:-2]) + (groups * per * 2,)
    return _mx(stem, codes_name, scale_name, where, "gpt-oss MXFP4", 2 * per, shape)


def headers_of(files: Iterable[Path | str], opener: Any) -> dict[str, list[TensorInfo]]:
    """Each file's stored tensors, through ``opener`` (a reader factory), headers only."""
    out: dict[str, list[TensorInfo]] = {}
    for file in files:
        with opener(file) as reader:
            out[os.fspath(file)] = list(reader.tensors.values())
    return out
