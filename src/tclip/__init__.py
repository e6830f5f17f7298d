"""tclip: clip tensors saved on disk with TensorFlow's semantics.

The NumPy core (TensorFlow's names and arguments)::

    >>> import numpy as np, tclip
    >>> tclip.clip_by_norm(np.array([3.0, 4.0]), 1.0)
    array([0.6, 0.8])

Streaming pieces for code that cannot hold a whole tensor: :class:`TensorStats`
(pass 1 statistics, mergeable) and :func:`plan_scales` (statistics -> factors).

Names are imported on first use (PEP 562), so ``tclip --help`` and shell
completion never pay for importing NumPy.
"""

from __future__ import annotations

from importlib import import_module
from typing import Any

from ._version import __version__

_EXPORTS = {
    "clip_by_value": "core.ops",
    "clip_by_norm": "core.ops",
    "clip_by_average_norm": "core.ops",
    "global_norm": "core.ops",
    "clip_by_global_norm": "core.ops",
    "norm": "core.ops",
    "TensorStats": "core.stats",
    "normalize_axes": "core.stats",
    "NormClip": "core.modes",
    "AverageNormClip": "core.modes",
    "GlobalNormClip": "core.modes",
    "ValueClip": "core.modes",
    "plan_scales": "core.modes",
    "scale_for_piece": "core.modes",
    "apply_scale": "core.modes",
    "stats_axes": "core.modes",
    "clip_file": "work.clip",
    "report_file": "work.clip",
    "file_info": "work.clip",
    "diff_files": "work.diff",
}

__all__ = ["__version__", *_EXPORTS]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'tclip' has no attribute {name!r}")
    value = getattr(import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(__all__)
