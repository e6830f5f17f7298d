"""tclip: clip tensors saved on disk with TensorFlow's semantics.

The Python API (docs/python.md)::

    import tclip
    with tclip.open("model.safetensors") as ck:   # any file, folder, index, set
        w = ck["model.layers.0.mlp.down_proj.weight"]
    rep = tclip.report("grads.safetensors", max_norm=1.0)
    rep.passed, rep.global_norm

and TensorFlow's clip functions for arrays in memory::

    >>> import numpy as np, tclip
    >>> tclip.clip_by_norm(np.array([3.0, 4.0]), 1.0)
    array([0.6, 0.8])

Names are imported on first use (PEP 562), so ``tclip --help`` and shell
completion never pay for importing NumPy.
"""

from __future__ import annotations

from importlib import import_module
from typing import Any

from ._version import __version__

_EXPORTS = {
    "open": "api",
    "report": "api",
    "summary": "api",
    "clip": "api",
    "diff": "api",
    "Checkpoint": "api",
    "TclipError": "errors",
    "clip_by_value": "core.ops",
    "clip_by_norm": "core.ops",
    "clip_by_average_norm": "core.ops",
    "global_norm": "core.ops",
    "clip_by_global_norm": "core.ops",
    "norm": "core.ops",
    "NormClip": "core.modes",
    "AverageNormClip": "core.modes",
    "GlobalNormClip": "core.modes",
    "ValueClip": "core.modes",
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
