"""PyTorch files (``torch.save``), read without torch: the format as the registry sees it.

- :mod:`.reader`: :class:`TorchReader`, each tensor a view of a storage read with ``pread``;
- :mod:`.writer`: :class:`TorchWriter`, a rewrite of the same file in place;
- :mod:`.archive`: the zip (or legacy) container and its storages, loaded on first use (the pickle
  machine and zipfile cost 10 ms of every command's start-up);
- :mod:`.unpickler` and :mod:`.pickled`: the allowlist pickle interpreter, which calls nothing,
  and the values it builds.
"""

from __future__ import annotations

from .reader import (
    CONTENT_SUFFIXES,
    HOLDS_METADATA,
    NAME,
    SNIFF_BEFORE,
    SUFFIXES,
    TorchReader,
    View,
    sniff,
)
from .writer import TorchWriter, Writer

Reader = TorchReader

__all__ = ["CONTENT_SUFFIXES", "HOLDS_METADATA", "NAME", "Reader", "SNIFF_BEFORE", "SUFFIXES", "TorchReader",
           "TorchWriter", "View", "Writer", "sniff"]
