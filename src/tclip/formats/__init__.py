"""Bytes <-> tensors: the reader/writer protocol, one module per format, and their registry.

- :mod:`~tclip.formats.base`: :class:`TensorInfo`, :class:`TensorReader`, :class:`TensorWriter`;
- :mod:`~tclip.formats.registry`: the formats, detection, :func:`open_reader`, :func:`create_writer`;
- :mod:`~tclip.formats.atomic`: outputs that appear atomically (temporary file, fsync, rename);
- one module per format: :mod:`~tclip.formats.npy`, :mod:`~tclip.formats.npz`,
  :mod:`~tclip.formats.safetensors`, :mod:`~tclip.formats.hdf5`, :mod:`~tclip.formats.torch`;
  a format with helpers is a subpackage: :mod:`~tclip.formats.gguf` (the reader and writer,
  the header parser, ggml's types and block sizes);
- :mod:`~tclip.formats.sharded`: index files of sharded checkpoints, GGUF split sets and one reader over a set;
- private helpers: ``_blocks`` (index arithmetic), ``_io`` (raw byte I/O), ``_h5probe`` and
  ``_h5walk`` (the HDF5 library's work on untrusted files, in a child process), ``_torch_pickle`` and
  ``_torch_archive`` (torch.save files read without torch).

Nothing here computes statistics or clips: the formats know nothing of norms (nothing here
imports ``core.kernels`` or ``core.stats``). A format lists what is stored: a quantized weight
as stored parts or as blocks tagged with their ggml type (an :class:`Encoding` that only
describes); what they mean -- values, statistics, rescales -- is :mod:`tclip.quant`, the layer
above. The passes over files (:mod:`tclip.work`) know formats only through this protocol and
:mod:`tclip.quant`'s view of it.
"""

from __future__ import annotations

from .base import OtherObject, SharedElements, TensorInfo, TensorReader, TensorWriter
from .registry import (
    create_writer,
    detect_format,
    format_for_suffix,
    open_reader,
    register,
    unregister,
)

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
