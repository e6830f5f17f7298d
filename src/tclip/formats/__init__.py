"""Bytes <-> tensors: the reader/writer protocol, one module per format, and their registry.

- :mod:`~tclip.formats.base`: :class:`TensorInfo`, :class:`TensorReader`, :class:`TensorWriter`;
- :mod:`~tclip.formats.registry`: the formats, detection, :func:`open_reader`, :func:`create_writer`;
- :mod:`~tclip.formats.atomic`: outputs that appear atomically (temporary file, fsync, rename);
- one module per format: :mod:`~tclip.formats.npy`, :mod:`~tclip.formats.npz`,
  :mod:`~tclip.formats.safetensors`, :mod:`~tclip.formats.gguf`; a format with helpers is one
  package holding them: :mod:`~tclip.formats.hdf5` (values, safety checks, raw chunks, the writer,
  and the child process that does the HDF5 library's work on untrusted files),
  :mod:`~tclip.formats.torch` (torch.save files read without torch: archive, allowlist unpickler);
- :mod:`~tclip.formats.sharded`: index files of sharded checkpoints, GGUF split sets and one reader over a set;
- :mod:`~tclip.formats.quant_layout` and :mod:`~tclip.formats.quant_encoding`: quantized weights
  (codes plus scale tensors, across the files of a set) as one logical tensor each;
- private helpers: ``_blocks`` (index arithmetic), ``_io`` (raw byte I/O), ``_gguf_header`` (GGUF headers).

Nothing here clips: the formats know nothing of norms, the passes over files
(:mod:`tclip.work`) know formats only through this protocol.
"""

from __future__ import annotations

from importlib import import_module
from typing import Any

# Imported on first use (PEP 562): the command line imports ``formats.hdf5.child`` before
# NumPy to start the HDF5 child early, and that must not load every format on the way.
_LAZY = {"OtherObject": "base", "SharedElements": "base", "TensorInfo": "base", "TensorReader": "base",
         "TensorWriter": "base", "create_writer": "registry", "detect_format": "registry",
         "format_for_suffix": "registry", "open_reader": "registry", "register": "registry",
         "unregister": "registry"}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value


__all__ = [
    "OtherObject",
    "SharedElements",
    "TensorInfo",
    "TensorReader",
    "TensorWriter",
    "create_writer",
    "detect_format",
    "format_for_suffix",
    "open_reader",
    "register",
    "unregister",
]
