"""GGUF files (llama.cpp, ollama, LM Studio): one format, its modules in one place.

- :mod:`~tclip.formats.gguf.files`: the reader and writer (the format module the registry uses);
- :mod:`~tclip.formats.gguf.header`: the header parser (every count and length checked).
"""

from __future__ import annotations

from .files import HOLDS_METADATA, NAME, SUFFIXES, GgufReader, GgufWriter, Reader, Writer, sniff

__all__ = ["HOLDS_METADATA", "NAME", "SUFFIXES", "GgufReader", "GgufWriter", "Reader", "Writer", "sniff"]
