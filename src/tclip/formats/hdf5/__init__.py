"""HDF5 files through h5py: every numeric dataset is a tensor named by its path.

The format as the registry sees it. This module is cheap to import (no NumPy, no
h5py): the command line imports :mod:`.child` before anything heavy, to start the
HDF5 child early. Reader and writer are imported on first use (PEP 562).

- :mod:`.reader`: :class:`Hdf5Reader` (tensors, values, the file's tree);
- :mod:`.writer`: :class:`Hdf5Writer`, rewrites in place of a byte copy;
- :mod:`.values`: HDF5 values as plain Python values; :mod:`.safety`: what is refused and why;
- :mod:`.chunks`: raw chunk I/O; :mod:`.mask`: a file with data regions read as other bytes;
- :mod:`.child`, :mod:`.probe`, :mod:`.walk`: the HDF5 library's work on untrusted files, in a child process.
"""

from __future__ import annotations

from importlib import import_module
from typing import Any, BinaryIO

from .child import HDF5_SUFFIXES

NAME = "hdf5"
SUFFIXES = HDF5_SUFFIXES  # (the command line starts the HDF5 child early for these)
HOLDS_METADATA = True
# Keras 3 loads weights only from names ending so: tclip's outputs keep the ending whole.
KEPT_ENDINGS = (".weights.h5",)
SIGNATURE = b"\x89HDF\r\n\x1a\n"


def sniff(head: bytes, size: int) -> bool:
    return head.startswith(SIGNATURE)


def sniff_file(handle: BinaryIO, size: int) -> bool:
    """The signature behind a user block of 512, 1024, 2048... bytes (HDF5 allows one)."""
    offset = 512
    while offset + 8 <= size:
        handle.seek(offset)
        if handle.read(8) == SIGNATURE:
            return True
        offset *= 2
    return False


# Names the rest of tclip takes from this package, by the module that defines them.
_LAZY = {"Reader": "reader", "Hdf5Reader": "reader", "import_h5py": "safety",
         "Writer": "writer", "Hdf5Writer": "writer", "DatasetWrites": "writer"}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value
