"""Which stored tensors are the codes of a quantized weight, and which are its scales.

A quantized checkpoint stores each weight as 8- or 4-bit codes plus scale
tensors; the real weight is codes x scales. Clipping codes or scales as if they
were plain values destroys the weight (the codes are rounded again, and codes and
scales are both multiplied), and their norms are not the weight's norm.

Until tclip understands the conventions, it recognises the pairs by name, as
every producer names them, and refuses to clip them (see README, "Quantized
checkpoints"):

- ``X.weight`` with ``X.weight_scale_inv`` (DeepSeek / Hugging Face fp8),
  ``X.weight_scale`` (compressed-tensors, ModelOpt FP8 and NVFP4),
  ``X.weight_scale_2`` (ModelOpt NVFP4), ``X.weight_global_scale``
  (compressed-tensors NVFP4) or ``X.weight_zero_point``;
- ``X.weight_packed`` with ``X.weight_scale`` (compressed-tensors packed codes);
- ``X_blocks`` with ``X_scales`` (gpt-oss MXFP4).

Activation scales (``input_scale``, ``k_scale``, ``v_scale``) belong to no weight.
"""

from __future__ import annotations

from collections.abc import Iterable

# Suffixes a scale tensor's name adds to its weight's name.
SCALE_SUFFIXES = ("_scale_inv", "_scale_2", "_global_scale", "_scale", "_zero_point")
# Names whose codes live under another name than the scale's stem.
PACKED_SUFFIX = "_packed"
BLOCKS_SUFFIX, SCALES_SUFFIX = "_blocks", "_scales"


def scale_companions(names: Iterable[str]) -> dict[str, list[str]]:
    """Each quantized weight's stored codes, mapped to its scale tensors (in name order).

    >>> scale_companions(["a.weight", "a.weight_scale_inv", "b.weight", "a.input_scale"])
    {'a.weight': ['a.weight_scale_inv']}
    """
    present = set(names)
    pairs: dict[str, list[str]] = {}
    for name in sorted(present):
        for suffix in SCALE_SUFFIXES:
            if not name.endswith(suffix):
                continue
            stem = name[: -len(suffix)]
            for weight in (stem, stem + PACKED_SUFFIX):
                if weight in present and weight != name:
                    pairs.setdefault(weight, []).append(name)
                    break
            break
        if name.endswith(SCALES_SUFFIX):
            weight = name[: -len(SCALES_SUFFIX)] + BLOCKS_SUFFIX
            if weight in present:
                pairs.setdefault(weight, []).append(name)
    return pairs


def quantized_members(names: Iterable[str]) -> dict[str, str]:
    """Every stored tensor that belongs to a quantized weight, mapped to that weight's name."""
    out: dict[str, str] = {}
    for weight, scales in scale_companions(names).items():
        out[weight] = weight
        for scale in scales:
            out[scale] = weight
    return out


def describe(weight: str, scales: list[str]) -> str:
    """``'X.weight' (scale 'X.weight_scale_inv')`` for messages."""
    label = "scale" if len(scales) == 1 else "scales"
    return f"{weight!r} ({label} {', '.join(repr(s) for s in scales)})"
