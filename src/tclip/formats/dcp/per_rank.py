"""DCP folders saved per rank, without one ``.metadata``, found by their files' names without
reading them (cheap: called on every folder an input names):

- DCP's Hugging Face storage saved per rank: ``shard-0000R-model-0000F-of-0000N.safetensors``
  pieces (read by :mod:`.hf_shards`);
- ``use_collectives=False`` saves: a ``__R.metadata`` per rank beside the ``*.distcp`` files (read
  by :mod:`.rank_metadata`).

:func:`standing_for` gives the path that stands for such a folder in a run's inputs."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

from . import METADATA_NAME

SHARDING_KEY = "DCP_SHARDING_INFO"
OFFSETS_KEY = "saved_offsets"
RANK_METADATA = re.compile(r"__(?P<rank>\d+)\.metadata")
PIECE_NAME = re.compile(r"shard-(?P<rank>\d{5,})-model-(?P<file>\d{5,})-of-(?P<count>\d{5,})\.safetensors")


def is_piece_name(name: str) -> bool:
    return PIECE_NAME.fullmatch(name) is not None


def piece_files(folder: Path | str) -> list[Path]:
    """The regular ``shard-*-model-*-of-*.safetensors`` files of a folder, by rank then file."""
    try:
        found = [p for p in Path(folder).iterdir() if is_piece_name(p.name) and p.is_file()]
    except OSError:
        return []
    return sorted(found, key=_order)


def _order(path: Path) -> tuple[int, int, str]:
    match = PIECE_NAME.fullmatch(path.name)
    assert match is not None
    return int(match["rank"]), int(match["file"]), path.name


def is_hf_shards_folder(folder: Path | str) -> bool:
    """A folder holding per-rank pieces of DCP's Hugging Face storage and no ``.metadata``."""
    folder = Path(folder)
    try:
        return folder.is_dir() and not (folder / METADATA_NAME).exists() and bool(piece_files(folder))
    except OSError:
        return False


def rank_metadata_files(folder: Path | str) -> list[Path]:
    """The folder's ``__R.metadata`` files, by rank."""
    try:
        found = [p for p in Path(folder).iterdir() if RANK_METADATA.fullmatch(p.name)]
    except OSError:
        return []
    return sorted(found, key=lambda p: (int(RANK_METADATA.fullmatch(p.name)["rank"]), p.name))  # type: ignore[index]


def is_rank_metadata_folder(folder: Path | str) -> bool:
    """A folder of ``__R.metadata`` files and ``*.distcp`` data, without ``.metadata``."""
    folder = Path(folder)
    try:
        return (folder.is_dir() and not (folder / METADATA_NAME).exists() and bool(rank_metadata_files(folder))
                and any(folder.glob("*.distcp")))
    except OSError:
        return False


def standing_for(folder: Path | str) -> Path | None:
    """What stands for a per-rank DCP folder among a run's inputs (the folder of Hugging Face
    pieces; the first ``__R.metadata``, which the DCP sniff claims, as ``.metadata`` stands for a
    coordinated save), or None for any other folder."""
    if is_hf_shards_folder(folder):
        return Path(folder)
    if is_rank_metadata_folder(folder):
        return rank_metadata_files(folder)[0]
    return None


def fold_pieces(paths: list[Path]) -> list[Path]:
    """``paths`` with the piece files of a folder replaced by the folder (where it first appears)
    when every piece of that folder is among them; a part of a folder's pieces stays as it is
    (each is then refused when opened, with a line naming the folder)."""
    pieces: dict[str, set[str]] = {}
    for path in paths:
        if is_piece_name(path.name):
            pieces.setdefault(os.path.normpath(path.parent), set()).add(path.name)
    whole = {folder for folder, names in pieces.items()
             if is_hf_shards_folder(folder) and names == {p.name for p in piece_files(folder)}}
    out: list[Path] = []
    seen: set[str] = set()
    for path in paths:
        folder = os.path.normpath(path.parent)
        if is_piece_name(path.name) and folder in whole:
            path = path.parent
        key = os.path.normpath(path)
        if key not in seen:
            seen.add(key)
            out.append(path)
    return out


def checkpoint_files(folder: Path | str) -> list[Path]:
    """The files a per-rank DCP folder's checkpoint is made of (its pieces; its ``__R.metadata``
    and ``*.distcp`` files): none of them is a side file to copy beside a conversion."""
    if is_hf_shards_folder(folder):
        return piece_files(folder)
    if is_rank_metadata_folder(folder):
        return [*rank_metadata_files(folder), *sorted(Path(folder).glob("*.distcp"))]
    return []


MAX_SHARDING_INFO = 64 << 20  # (bytes of DCP_SHARDING_INFO parsed at most)


def piece_problem(path: Path, metadata: dict[str, Any]) -> str | None:
    """Why a safetensors file must not be read alone: it is one rank's piece of a DCP checkpoint
    (named so, or placed off the origin by its ``DCP_SHARDING_INFO``). A file torch's writer
    saved from one rank's full state dict (every offset zero, named ``model-*``) is whole."""
    info = metadata.get(SHARDING_KEY)
    if info is None:
        return None
    if not is_piece_name(path.name):
        try:
            parsed = json.loads(info) if isinstance(info, str) and len(info) <= MAX_SHARDING_INFO else None
        except (ValueError, RecursionError):
            parsed = None
        if isinstance(parsed, dict) and all(isinstance(v, dict) and isinstance(v.get(OFFSETS_KEY), list)
                                            and not any(v[OFFSETS_KEY]) for v in parsed.values()):
            return None
    return (f"one rank's pieces of a DCP checkpoint ({SHARDING_KEY} in its __metadata__): its shapes are not "
            f"its tensors' own; give the folder ({path.parent}) to read them whole")
