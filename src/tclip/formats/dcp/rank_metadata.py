"""A DCP folder saved without rank coordination: one ``__R.metadata`` per rank, no ``.metadata``.

``dcp.save(..., use_collectives=False)`` (torch 2.13, "experimental") has every rank plan alone:
rank ``R`` writes its items into ``__R_0.distcp`` and its own metadata, the same pickle as
``.metadata`` but listing only its chunks, into ``__R.metadata``; loading, each rank reads its own.
Here every rank's file is read through the same allowlist (:func:`._metadata.load_dcp_metadata`)
and merged into one :class:`~._metadata.DcpMetadata`, then checked and read as a ``.metadata`` is
(:class:`~.reader.DcpReader`):

- a tensor's global shape, dtype and layout must be the same in every rank's file;
- its chunks are the union of the ranks' chunks. A chunk that several ranks saved at the same
  offsets and sizes (a replicated tensor: no rank coordination, so no deduplication) is read from
  the lowest rank; chunks that overlap otherwise, or leave part of the tensor unwritten, are
  refused as in any DCP folder;
- an item saved as an object by several ranks (``step``) is taken from the lowest rank.

Any ``__R.metadata`` of the folder (or the folder) stands for all of them: one rank's file alone
would list only its pieces.
"""

from __future__ import annotations

import dataclasses
import os
import re
import stat
from pathlib import Path

from ...errors import FormatError, UnsupportedError
from ..torch.pickled import PickleLimits
from ._metadata import BytesEntry, Chunk, DcpMetadata, StorageItem, TensorEntry, load_dcp_metadata
from .per_rank import RANK_METADATA, rank_metadata_files
from .reader import DcpReader

_NO_METADATA = re.compile(r"(?<![\w.])\.metadata\b")


class RankMetadataReader(DcpReader):
    """A DCP folder of per-rank ``__R.metadata`` files (given as the folder or any of them)."""

    def __init__(self, path: Path) -> None:
        path = Path(path)
        folder = path if path.is_dir() else path.parent
        self.rank_files = rank_metadata_files(folder)
        if not self.rank_files:
            raise FormatError("no __R.metadata files: not a DCP checkpoint folder", folder)
        super().__init__(self.rank_files[0])

    def bad(self, what: str) -> FormatError:
        # the checks of DcpReader name ".metadata"; here they are about the ranks' files merged
        return super().bad(_NO_METADATA.sub("the ranks' metadata", what))

    def _load_metadata(self, data: bytes, limits: PickleLimits) -> DcpMetadata:
        ranks = [int(RANK_METADATA.fullmatch(p.name)["rank"]) for p in self.rank_files]  # type: ignore[index]
        if ranks != list(range(len(ranks))):
            missing = min(set(range(ranks[-1] + 1)) - set(ranks))
            raise self.bad(f"no __{missing}.metadata, though ranks up to {ranks[-1]} saved theirs: part of the "
                           "checkpoint is missing")
        merged = DcpMetadata()
        chunks: dict[str, dict[Chunk, str]] = {}  # each tensor's chunks, with the rank's file that placed each
        for path in self.rank_files:
            raw = data if path == self.rank_files[0] else self._read(path, limits)
            part = load_dcp_metadata(raw, limits=limits, where=path.name, path=self.path)
            merged.version = merged.version or part.version
            merged.has_planner_data = merged.has_planner_data or part.has_planner_data
            self._merge(path.name, part, merged, chunks)
        return merged

    def _merge(self, where: str, part: DcpMetadata, merged: DcpMetadata, chunks: dict[str, dict[Chunk, str]]) -> None:
        """Add one rank's entries and items to ``merged`` (see the module's docstring)."""
        items: dict[tuple[str, int | None], StorageItem] = {}
        for item in part.items:
            entry = part.entries.get(item.fqn)
            in_range = isinstance(entry, BytesEntry) or (isinstance(entry, TensorEntry) and item.index is not None
                                                         and 0 <= item.index < len(entry.chunks))
            if entry is None or (item.fqn, item.index) in items or not in_range:
                raise self.bad(f"{where}: storage_data names item {item.index} of {item.fqn!r}, which its "
                               "state_dict_metadata does not list (or lists twice)")
            items[item.fqn, item.index] = item
        for name, entry in part.entries.items():
            known = merged.entries.get(name)
            if isinstance(entry, BytesEntry):
                if known is None:
                    merged.entries[name] = entry
                    merged.items += [i for k, i in items.items() if k[0] == name]
                elif not isinstance(known, BytesEntry):
                    raise self.bad(f"{where}: {name!r} is a tensor in one rank's metadata, an object in another's")
                continue
            if known is None:
                known = merged.entries[name] = TensorEntry(entry.dtype, entry.shape, (), entry.layout)
            if not isinstance(known, TensorEntry) or (known.dtype, known.shape, known.layout) != \
                    (entry.dtype, entry.shape, entry.layout):
                raise self.bad(f"{where}: the ranks' metadata disagree about {name!r} ({_describe(known)} and "
                               f"{_describe(entry)})")
            placed = chunks.setdefault(name, {})
            added = list(known.chunks)
            for i, chunk in enumerate(entry.chunks):
                if placed.get(chunk, where) != where:
                    continue  # saved by a lower rank too (replicated): read from there
                placed[chunk] = where  # (a chunk listed twice by one rank stays twice: an overlap, refused)
                found = items.get((name, i))
                if found is not None:
                    merged.items.append(dataclasses.replace(found, index=len(added)))
                added.append(chunk)
            merged.entries[name] = dataclasses.replace(known, chunks=tuple(added))

    def _read(self, path: Path, limits: PickleLimits) -> bytes:
        """A rank's metadata file, read as ``.metadata`` is: a regular file within the size limit."""
        try:
            fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0))
            with os.fdopen(fd, "rb") as handle:
                if not stat.S_ISREG(os.fstat(fd).st_mode):
                    raise self.bad(f"{path.name} is not a regular file")
                if os.fstat(fd).st_size > limits.max_bytes:
                    raise UnsupportedError(f"{path.name} of {os.fstat(fd).st_size} bytes is larger than the limit of "
                                           f"{limits.max_bytes} bytes", self.path)
                return handle.read(limits.max_bytes + 1)
        except OSError as error:
            raise self.bad(f"cannot read {path.name} ({error.strerror or error})") from None


def _describe(entry: TensorEntry | BytesEntry) -> str:
    if isinstance(entry, BytesEntry):
        return "an object"
    return f"torch.{entry.dtype} {list(entry.shape)}" + ("" if entry.layout == "torch.strided" else f" {entry.layout}")
