"""Bytes <-> tensors: the reader/writer protocol, one module per format, and their registry.

- :mod:`~tclip.formats.base`: :class:`TensorInfo`, :class:`TensorReader`, :class:`TensorWriter`;
- :mod:`~tclip.formats.registry`: the formats, detection, :func:`open_reader`, :func:`create_writer`;
- :mod:`~tclip.formats.atomic`: outputs that appear atomically (temporary file, fsync, rename);
- one module per format: :mod:`~tclip.formats.npy`, :mod:`~tclip.formats.npz`,
  :mod:`~tclip.formats.safetensors`; a format with helpers is one package holding them:
  :mod:`~tclip.formats.gguf` (the reader and writer, the header parser, ggml's types and block sizes),
  :mod:`~tclip.formats.hdf5` (values, safety checks, raw chunks, the writer, and the child process
  that does the HDF5 library's work on untrusted files), :mod:`~tclip.formats.torch` (torch.save
  files read without torch: archive, allowlist unpickler), :mod:`~tclip.formats.dcp` (PyTorch
  Distributed Checkpoint folders);
- :mod:`~tclip.formats.sharded`: index files of sharded checkpoints, GGUF split sets and one reader over a set;
- private helpers: ``_blocks`` (index arithmetic), ``_io`` (raw byte I/O).

Nothing here computes statistics or clips: the formats know nothing of norms (nothing here
imports ``core.kernels`` or ``core.stats``). A format lists what is stored: a quantized weight
as stored parts or as blocks tagged with their ggml type (an :class:`Encoding` that only
describes); what they mean -- values, statistics, rescales -- is :mod:`tclip.quant`, the layer
above. The passes over files (:mod:`tclip.work`) know formats only through this protocol and
:mod:`tclip.quant`'s view of it.
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
