"""Tensors that share bytes of their file (tied weights, views of one buffer in a PyTorch file).

Rewriting such a file in its own format writes each shared byte once, so the
tensors sharing it must come out of the plan with one result for it: identical
views (``lm_head.weight`` tied to ``embed_tokens.weight``) need the same work;
other overlapping views (a weight and its transpose, a row of it) need the same
single factor, or the same value bounds. A tensor that shares bytes with a
rewritten one and is not rewritten itself would change unasked, so that is
refused too, except under ``value`` for a selected tensor of the same dtype: it
was left alone because all its values are within the bounds, which the rewrite of
the other then leaves as they are. Converting to another format writes every
tensor apart, and needs none of this.

A negated view (torch's neg bit: the values are the stored elements negated) and its
plain twin agree on a clip to bounds only when the bounds are symmetric around zero;
otherwise clipping one would write values to the other that were not reported, so
that is refused. A view holding some stored element at two indices (a stride 0, an
unfold) takes one bound pair or one factor everywhere; factors per slice are written
only when every repeated element gets the same one from each of its indices.
"""

from __future__ import annotations

import numpy as np

from ..errors import UnsupportedError
from .plan import TensorWork
from .statistics import FileStats


def check_tied(stats: FileStats, work: dict[str, TensorWork], mode_name: str) -> None:
    """Refuse a plan that would give bytes shared by two tensors two different results.

    Args:
        stats: pass 1 of the file (its ``overlaps`` and which tensors were selected).
        work: the plan's work for the file.
        mode_name: the clip mode, for the message.

    Raises:
        UnsupportedError: naming both tensors and why; nothing has been written.
    """
    selected = set(stats.selected)
    dtypes = {t.name: t.dtype for t in stats.tensors}
    encoded = {t.name for t in stats.tensors if t.encoding is not None}
    _check_repeats(stats, work, mode_name)
    negated = stats.shared.negated
    for first, second, same in stats.overlaps:
        a, b = work.get(first), work.get(second)
        task = a if a is not None else b
        if task is not None and task.bounds is not None and (first in negated) != (second in negated) \
                and task.bounds[0] != -task.bounds[1]:
            raise UnsupportedError(
                f"tensors {first!r} and {second!r} share storage in the file, one of them negated, and clipping to "
                f"[{task.bounds[0]:.6g}, {task.bounds[1]:.6g}] would write to one of them values that were not "
                "reported; nothing was written. Bounds symmetric around zero clip both alike; a conversion to "
                "safetensors stores each apart", stats.path)
        if a is None and b is None:
            continue
        if first in encoded or second in encoded:
            # A quantized weight is rewritten through its scales, the other tensor through its
            # values: no factor makes the two agree on the bytes they share.
            weight, other = (first, second) if first in encoded else (second, first)
            raise UnsupportedError(
                f"the quantized weight {weight!r} shares bytes in the file with tensor {other!r}, and {mode_name} "
                "would rewrite them in two ways (its scales, the other's values); nothing was written",
                stats.path)
        if a is not None and b is not None:
            if _same_result(a, b, same and dtypes[first] == dtypes[second]):
                continue
            raise UnsupportedError(
                f"tensors {first!r} and {second!r} share storage in the file, and {mode_name} would change them "
                f"differently ({_effects(a, b)}), but each shared value is stored once; nothing was "
                "written. The global mode scales them by one factor; a conversion to safetensors stores each apart",
                stats.path)
        changed, other = (first, second) if a is not None else (second, first)
        task = a if a is not None else b
        assert task is not None
        if task.bounds is not None and other in selected and dtypes[other] == dtypes[changed]:
            continue  # all of other's values are within the bounds: the rewrite leaves them as they are
        why = "would be left unchanged" if other in selected else "is not selected"
        raise UnsupportedError(
            f"clipping tensor {changed!r} would change tensor {other!r} too (they share storage in the file), "
            f"which {why}; nothing was written. Select both, or convert to safetensors, which stores each apart",
            stats.path)


def _check_repeats(stats: FileStats, work: dict[str, TensorWork], mode_name: str) -> None:
    """Refuse factors per slice that give a stored element held at two indices two factors."""
    for name, (shape, strides) in stats.shared.repeating.items():
        task = work.get(name)
        if task is None or task.bounds is not None or task.scale is None or _uniform(task.scale) is not None:
            continue
        size = int(np.prod(shape))
        if size <= _MAX_REPEAT_CHECK and _factors_agree(np.broadcast_to(task.scale, shape), strides):
            continue
        raise UnsupportedError(
            f"tensor {name!r} is a view holding some stored elements more than once (at several indices), and "
            f"{mode_name} would give them different factors ({_effect(task)}); nothing was written. One factor "
            "for the whole tensor (no axes) works, and a conversion to safetensors stores each index apart",
            stats.path)


_MAX_REPEAT_CHECK = 1 << 24  # factors of a repeating view checked element by element, at most


def _factors_agree(factors: np.ndarray, strides: tuple[int, ...]) -> bool:
    """Whether every stored element of a view (``strides`` in elements) gets one factor from all
    its indices: each index writes its factor to its element, and reads back its own."""
    span = sum((n - 1) * s for n, s in zip(factors.shape, strides)) + 1
    stored = np.zeros(span, np.float64)
    at = np.lib.stride_tricks.as_strided(stored, factors.shape, [s * 8 for s in strides], writeable=True)
    at[...] = factors
    return bool(np.array_equal(at, factors, equal_nan=True))


def _same_result(a: TensorWork, b: TensorWork, same_view: bool) -> bool:
    if a.bounds is not None or b.bounds is not None:
        return a.bounds == b.bounds
    assert a.scale is not None and b.scale is not None
    if same_view:
        return a.scale.shape == b.scale.shape and bool(np.array_equal(a.scale, b.scale))
    # different views of the same elements: only one factor for every element agrees
    return _uniform(a.scale) is not None and _uniform(a.scale) == _uniform(b.scale)


def _uniform(scale: np.ndarray) -> float | None:
    values = np.unique(scale)
    return float(values[0]) if values.size == 1 else None


def _effects(a: TensorWork, b: TensorWork) -> str:
    """``"×0.5 and ×0.25"``; with all their digits where six do not tell the two apart."""
    first, second = _effect(a), _effect(b)
    if first == second:
        first, second = _effect(a, 17), _effect(b, 17)
    return f"{first} and {second}"


def _effect(task: TensorWork, digits: int = 6) -> str:
    if task.bounds is not None:
        return f"bounds [{task.bounds[0]:.{digits}g}, {task.bounds[1]:.{digits}g}]"
    assert task.scale is not None
    factor = _uniform(task.scale)
    return f"×{factor:.{digits}g}" if factor is not None else f"{task.scale.size} factors, one per slice"

