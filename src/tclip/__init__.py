"""tclip: clip tensors saved on disk exactly as TensorFlow, PyTorch and optax would.

The NumPy core (TensorFlow's names and arguments)::

    >>> import numpy as np, tclip
    >>> tclip.clip_by_norm(np.array([3.0, 4.0]), 1.0)
    array([0.6, 0.8])

Streaming pieces for code that cannot hold a whole tensor: :class:`TensorStats`
(pass 1 statistics, mergeable) and :func:`plan_scales` (statistics -> factors).
"""

from ._version import __version__
from .ops import (
    clip_by_average_norm,
    clip_by_global_norm,
    clip_by_norm,
    clip_by_value,
    global_norm,
    norm,
)
from .plan import (
    AverageNormClip,
    GlobalNormClip,
    NormClip,
    ValueClip,
    apply_scale,
    plan_scales,
    scale_for_piece,
    stats_axes,
)
from .stats import TensorStats, normalize_axes

__all__ = [
    "__version__",
    "clip_by_value",
    "clip_by_norm",
    "clip_by_average_norm",
    "global_norm",
    "clip_by_global_norm",
    "norm",
    "TensorStats",
    "normalize_axes",
    "NormClip",
    "AverageNormClip",
    "GlobalNormClip",
    "ValueClip",
    "plan_scales",
    "scale_for_piece",
    "apply_scale",
    "stats_axes",
]
