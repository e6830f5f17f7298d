"""PyTorch Distributed Checkpoints (DCP): a folder of ``.metadata`` plus ``__R_K.distcp`` files,
read as one tensor source without torch and without running pickle.

- :mod:`._metadata`: ``.metadata`` through an allowlist of the DCP record classes;
- :mod:`.reader`: :class:`~.reader.DcpReader`, tensors assembled from their chunks;
- :mod:`.writer`: :class:`~.writer.DcpWriter`, a folder rewritten as a copy of itself (same sizes,
  ``.metadata`` byte for byte), the clipped chunks' bytes and CRC-32s set anew.

A DCP folder is recognised by its ``.metadata`` (the sniff below: a pickle whose first global is
DCP's ``Metadata`` class); no file suffix names the format. A DCP folder is written only as a
rewrite of one, into another folder (its ``.metadata`` is the writer's target).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any


# The reader (and the pickle machine it needs) is imported when a DCP folder is opened: importing
# the registry, which imports every format module, must stay cheap.
if TYPE_CHECKING:
    from .hf_shards import HfShardsReader
    from .rank_metadata import RankMetadataReader
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
    """A rewrite of a DCP folder into another folder (see :mod:`.writer`); ``target`` is its ``.metadata``."""
    from .writer import Writer as write_dcp

    return write_dcp(target, tensors, output, like=like, metadata=metadata, rewritten=rewritten)


def Reader(path: Path) -> DcpReader | HfShardsReader | RankMetadataReader:  # noqa: N802 (the format's reader)
    """A :class:`~.reader.DcpReader` of the folder, or of the folder of a ``.metadata``; for the
    folders saved per rank (:mod:`.per_rank`), an :class:`~.hf_shards.HfShardsReader` (Hugging
    Face pieces) or a :class:`~.rank_metadata.RankMetadataReader` (``__R.metadata`` files)."""
    from .reader import DcpReader

    from .per_rank import RANK_METADATA, is_rank_metadata_folder

    if is_hf_shards_folder(path):
        from .hf_shards import HfShardsReader

        return HfShardsReader(path)
    if RANK_METADATA.fullmatch(Path(path).name) or is_rank_metadata_folder(path):
        from .rank_metadata import RankMetadataReader

        return RankMetadataReader(path)
    return DcpReader(path)


def is_hf_shards_folder(folder: Path | str) -> bool:
    """A folder of ``shard-0000R-model-*.safetensors`` pieces (DCP's Hugging Face storage saved
    per rank) without ``.metadata``."""
    from .per_rank import is_hf_shards_folder as found

    return found(folder)


def is_dcp_folder(folder: Path | str) -> bool:
    """A folder holding ``.metadata`` and at least one ``*.distcp`` (what FileSystemWriter writes)."""
    folder = Path(folder)
    try:
        return (folder / METADATA_NAME).is_file() and any(folder.glob("*.distcp"))
    except OSError:
        return False


__all__ = ["NAME", "SUFFIXES", "METADATA_NAME", "Reader", "Writer", "is_dcp_folder", "is_hf_shards_folder", "sniff"]
