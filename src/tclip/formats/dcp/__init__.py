"""PyTorch Distributed Checkpoints (DCP): a folder of ``.metadata`` plus ``__R_K.distcp`` files,
read as one tensor source without torch and without running pickle.

- :mod:`._metadata`: ``.metadata`` through an allowlist of the DCP record classes;
- :mod:`.reader`: :class:`~.reader.DcpReader`, tensors assembled from their chunks.

A DCP folder is recognised by its ``.metadata`` (the sniff below: a pickle whose first global is
DCP's ``Metadata`` class); no file suffix names the format. Writing DCP is not supported.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from ...errors import UnsupportedError

# The reader (and the pickle machine it needs) is imported when a DCP folder is opened: importing
# the registry, which imports every format module, must stay cheap.
if TYPE_CHECKING:
    from .reader import DcpReader

NAME = "dcp"
SUFFIXES: tuple[str, ...] = ()
HOLDS_METADATA = False

METADATA_NAME = ".metadata"

_CLASSES = (b"\x8c%torch.distributed.checkpoint.metadata", b"\x8c1megatron.core.dist_checkpointing.strategies.torch")


def sniff(head: bytes, size: int) -> bool:
    """A pickle (protocol 2 or later) whose first global is DCP's ``Metadata`` (or Megatron's),
    or a Megatron folder's ``metadata.json`` (its reader reads the folder, or says why not)."""
    if head[:1] == b"{":
        from .layouts import sniff_config

        return sniff_config(head)
    if not head.startswith(b"\x80") or len(head) < 3 or head[1] < 2:
        return False
    start = head[:120]
    return any(module in start for module in _CLASSES) and (b"\x8c\x08Metadata" in start
                                                             or b"\x8c\x0dMCoreMetadata" in start)


def Writer(target: Path, tensors: list[Any], output: Any, *, like: Any, metadata: Any,  # noqa: N802
           rewritten: Any) -> Any:
    """Writing a DCP folder is not supported (yet): refused with one line."""
    raise UnsupportedError("tclip does not write DCP checkpoints; write .safetensors instead", target)


def Reader(path: Path) -> DcpReader:  # noqa: N802 (the format's reader)
    """A :class:`~.reader.DcpReader` of the folder, or of the folder of a ``.metadata``."""
    from .reader import DcpReader

    return DcpReader(path)


def is_dcp_folder(folder: Path | str) -> bool:
    """A folder holding ``.metadata`` and at least one ``*.distcp`` (what FileSystemWriter writes)."""
    folder = Path(folder)
    try:
        return (folder / METADATA_NAME).is_file() and any(folder.glob("*.distcp"))
    except OSError:
        return False


__all__ = ["NAME", "SUFFIXES", "METADATA_NAME", "Reader", "Writer", "is_dcp_folder", "sniff"]
