"""GGUF files (llama.cpp, ollama, LM Studio): one format, three modules.

- :mod:`~tclip.formats.gguf.files`: the reader and writer (the format module the registry uses);
- :mod:`~tclip.formats.gguf.header`: the header parser (every count and length checked);
- :mod:`~tclip.formats.gguf.ggml_types`: ggml's tensor types, their ids and block sizes.

The blocks' arithmetic is not a format's: it is :mod:`tclip.quant.ggml`.
"""

from __future__ import annotations

from .files import HOLDS_METADATA, NAME, SUFFIXES, GgmlStored, GgufReader, GgufWriter, Reader, Writer, sniff

__all__ = ["HOLDS_METADATA", "NAME", "SUFFIXES", "GgmlStored", "GgufReader", "GgufWriter", "Reader", "Writer", "sniff"]
