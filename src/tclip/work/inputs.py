"""Which files the inputs name, and where outputs go.

Inputs are paths, quoted globs, directories (a directory holding a
``*.index.json`` stands for that sharded set) and indexes; outputs are
``NAME.clipped.EXT`` beside the input, or in an output folder, or the input
itself (in place). Outputs are checked against every input of a run before
anything is written."""

from __future__ import annotations

import glob
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from ..errors import TclipError
from ..formats.dcp import METADATA_NAME, is_dcp_folder
from ..formats.registry import claimed_by_content, content_suffixes, kept_endings, suffixes
from ..messages import Option
from ..text import natural_key
from .options import ClipOptions
from .results import Note, NoteKind


def default_output(path: Path, out_dir: Path | None = None) -> Path:
    """``grads.npz`` -> ``grads.clipped.npz`` beside it, or ``out_dir/grads.npz``.

    Keras 3 loads weights only from names ending in ``.weights.h5``, so
    ``model.weights.h5`` -> ``model.clipped.weights.h5``.
    """
    path = Path(path)
    if out_dir is not None:
        return Path(out_dir) / path.name
    for ending in kept_endings():
        cut = len(ending)
        if path.name.lower().endswith(ending) and len(path.name) > cut:
            return path.with_name(f"{path.name[:-cut]}.clipped{path.name[-cut:]}")
    return path.with_name(f"{path.stem}.clipped{path.suffix}")


def output_for(path: Path, options: ClipOptions) -> Path:
    """Where clipping ``path`` writes (not checked: see :func:`check_outputs`)."""
    if options.in_place:
        # A symlink stays a symlink: its target is what gets replaced.
        return Path(os.path.realpath(path))
    return Path(options.output) if options.output is not None else default_output(path, options.out_dir)


def check_outputs(outputs: dict[Path, Path], inputs: list[Path]) -> None:
    """Refuse, before anything is written, an output (``outputs`` maps each input to its
    output) that is one of ``inputs`` -- the same file by device and inode, through
    symlinks and hard links -- or that two inputs share. ``--force`` replaces old
    outputs, never an input nor another input's output, so it changes nothing here.
    """
    identities: dict[tuple[int, int], Path] = {}
    for path in inputs:
        try:
            st = os.stat(path)
        except OSError:
            continue  # reported when it is read
        identities.setdefault((st.st_dev, st.st_ino), Path(path))
    claimed: dict[str, Path] = {}
    for source, out in outputs.items():
        try:
            st = os.stat(out)
        except OSError:
            pass
        else:
            replaced = identities.get((st.st_dev, st.st_ino))
            if replaced is not None:
                raise TclipError((f"the output {out} would replace the input {replaced}; nothing was written (",
                                  Option.IN_PLACE, " replaces inputs)"), source)
        first = claimed.setdefault(os.path.realpath(out), source)
        if first != source and not _same_file(first, source):
            raise TclipError(f"{first} and {source} would both be written to this file; nothing was written "
                             "(clip them into separate folders)", out)


def _same_file(a: Path, b: Path) -> bool:
    try:
        return os.path.samefile(a, b)
    except OSError:
        return False


def is_tensor_file(path: Path) -> bool:
    own_output = path.stem.endswith(".clipped") or any(path.name.lower().endswith(".clipped" + ending)
                                                       for ending in kept_endings())
    suffix = path.suffix.lower()
    if suffix not in suffixes() or own_output:
        return False
    # a .bin may be anything (a tokenizer's or another tool's data): a tensor file when its content says so
    return suffix not in content_suffixes() or claimed_by_content(path)


SAFETENSORS_INDEX_SUFFIX = ".safetensors.index.json"
SAFETENSORS_SINGLE = "model.safetensors"  # an unsharded Hugging Face checkpoint's weights


def folder_indexes(folder: Path, notes: list[tuple[str, Note]] | None = None) -> list[Path]:
    """The indexes a folder stands for. Hugging Face repositories often ship the same
    weights twice (``model.safetensors.index.json`` and ``pytorch_model.bin.index.json``,
    or an unsharded ``model.safetensors`` beside a sharded ``.bin`` set); as
    ``from_pretrained`` does, the safetensors index (or ``model.safetensors``, then the
    one path returned) is taken and the others left, with a note in ``notes`` (folder, note)."""
    indexes = sorted(Path(folder).glob("*.index.json"), key=lambda p: natural_key(p.name))
    safe_ones = [p for p in indexes if p.name.endswith(SAFETENSORS_INDEX_SUFFIX)]
    single = Path(folder) / SAFETENSORS_SINGLE
    if indexes and not safe_ones and single.is_file():
        # from_pretrained loads model.safetensors before any .bin index: so does the folder here
        if notes is not None:
            notes.append((str(folder), Note(NoteKind.INDEX_CHOSEN, (
                f"holds {SAFETENSORS_SINGLE} and {', '.join(p.name for p in indexes)}; using {SAFETENSORS_SINGLE} "
                f"(as Hugging Face's from_pretrained does) and leaving {', '.join(p.name for p in indexes)}"))))
        return [single]
    if not safe_ones or len(safe_ones) == len(indexes):
        return indexes
    left = [p.name for p in indexes if p not in safe_ones]
    if notes is not None:
        notes.append((str(folder), Note(NoteKind.INDEX_CHOSEN, (
            f"holds {', '.join(p.name for p in safe_ones)} and {', '.join(left)}; using the safetensors "
            f"index (as Hugging Face's from_pretrained does) and leaving {', '.join(left)}"))))
    return safe_ones


def expand_files(items: tuple[str, ...], recursive: bool,
                 notes: list[tuple[str, Note]] | None = None) -> Iterator[tuple[str, Path | None]]:
    """(display name, path) per input; path None when the item matched nothing.

    A directory holding a ``*.safetensors.index.json`` stands for that sharded set
    (see :func:`folder_indexes` for a folder holding two indexes).
    """
    for item in items:
        path = Path(item)
        # os.path's tests answer False for a name too long (ENAMETOOLONG) where Path's raise:
        # such an item then fails alone, with one line, when it is opened.
        if os.path.isdir(path):
            if is_dcp_folder(path):  # a DCP checkpoint: its .metadata stands for the folder
                yield str(path), path / METADATA_NAME
                continue
            indexes = folder_indexes(path, notes)
            if indexes:
                for index in indexes:
                    yield str(index), index
                continue
            found = sorted(path.rglob("*") if recursive else path.iterdir(), key=lambda p: _natural(str(p)))
            # a DCP folder inside (checkpoint/step-100/) counts as one file: its .metadata
            files = [p / METADATA_NAME if p.is_dir() else p for p in found
                     if p.is_dir() and is_dcp_folder(p) or p.is_file() and is_tensor_file(p)]
            if not files:
                yield item, None
            for p in files:
                yield str(p), p
        elif os.path.lexists(path) or not glob.has_magic(item):
            yield item, path
        else:
            matches = sorted(glob.glob(item, recursive=recursive), key=_natural)
            # a DCP folder matched ('checkpoint/step-*') stands for its .metadata
            files = [Path(m) / METADATA_NAME if is_dcp_folder(Path(m)) else Path(m) for m in matches
                     if is_dcp_folder(Path(m)) or Path(m).is_file() and is_tensor_file(Path(m))]
            if not files:
                yield item, None
            for p in files:
                yield str(p), p


def diff_input(item: str, notes: list[tuple[str, Note]] | None = None) -> str:
    """A side of ``diff``: a file, an index, or a directory holding exactly one index
    (a safetensors one preferred: :func:`folder_indexes`)."""
    path = Path(item)
    if not path.is_dir():
        return item
    if is_dcp_folder(path):
        return str(path / METADATA_NAME)
    indexes = folder_indexes(path, notes)
    if len(indexes) == 1:
        return str(indexes[0])
    if not indexes:
        raise TclipError("is a directory without a *.index.json; name a file or an index", item)
    raise TclipError(f"holds {len(indexes)} indexes ({', '.join(p.name for p in indexes)}); name one", item)


def _natural(text: str) -> list[Any]:
    return natural_key(text)
