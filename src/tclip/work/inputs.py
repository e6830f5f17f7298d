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
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import NoTensorsError, TclipError
from ..formats import torch as pytorch
from ..formats.dcp import METADATA_NAME, is_dcp_folder
from ..formats.dcp.per_rank import fold_pieces, standing_for
from ..formats.dcp.layouts import MEGATRON_CONFIG, inner_checkpoint, is_megatron_folder
from ..formats.registry import claimed_by_content, content_suffixes, detect_format, kept_endings, open_reader, suffixes
from ..formats.sharded import INDEX_SUFFIX, load_index
from ..messages import Option
from ..text import name_list, natural_key
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
    output) that is one of ``inputs`` -- the same file by device and inode, named by the
    input's own directory entry or through a symlink -- or that two inputs share. Another
    hard link of an input may be an output: the rename replaces that name only, and the
    input's name keeps the old file. ``--force`` replaces old outputs, never an input nor
    another input's output, so it changes nothing here.
    """
    identities: dict[tuple[int, int], list[Path]] = {}
    for path in inputs:
        try:
            st = os.stat(path)
        except OSError:
            continue  # reported when it is read
        identities.setdefault((st.st_dev, st.st_ino), []).append(Path(path))
    claimed: dict[str, Path] = {}
    for source, out in outputs.items():
        try:
            st = os.stat(out)
        except OSError:
            pass
        else:
            replaced = next((path for path in identities.get((st.st_dev, st.st_ino), ())
                             if _replaces(Path(out), path)), None)
            if replaced is not None:
                raise TclipError((f"the output {out} would replace the input {replaced}; nothing was written (",
                                  Option.IN_PLACE, " replaces inputs)"), source)
        first = claimed.setdefault(os.path.realpath(out), source)
        if first != source and not _same_file(first, source):
            raise TclipError(f"{first} and {source} would both be written to this file; nothing was written "
                             "(clip them into separate folders)", out)


def _replaces(out: Path, path: Path) -> bool:
    """Whether renaming a file to ``out`` (the same file as input ``path``) replaces the input:
    ``out`` is a symlink, or the directory entry of ``path`` or of the file it links to. (Names
    are compared without case: on a case-insensitive file system ``G.npz`` is ``g.npz``.)"""
    if os.path.islink(out):
        return True
    for entry in (path, Path(os.path.realpath(path))):
        if out.name.casefold() == entry.name.casefold() and _same_file(out.parent, entry.parent):
            return True
    return False


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


@dataclass
class Found:
    """What expanding folders and globs found besides tensor files: the Hugging Face weights
    file (``model.safetensors``) that stands for each folder holding one and no index, and the
    ``.metadata`` of each DCP folder (its output takes the folder's other files along into
    ``--out-dir``)."""

    weights: dict[Path, Path] = field(default_factory=dict)  # the weights file -> its folder


def expand_files(items: tuple[str, ...], recursive: bool, notes: list[tuple[str, Note]] | None = None,
                 found: Found | None = None) -> Iterator[tuple[str, Path | None]]:
    """(display name, path) per input; path None when the item matched nothing.

    A directory holding a ``*.safetensors.index.json`` stands for that sharded set
    (see :func:`folder_indexes` for a folder holding two indexes). A quoted glob gives
    what its matches would give one by one: files, folders and indexes (shards of an
    index it matches are that index's). Files of a folder or a glob that hold no tensors
    tclip reads are left out with a note (named alone, such a file is an error).
    """
    for item in items:
        path = Path(item)
        # os.path's tests answer False for a name too long (ENAMETOOLONG) where Path's raise:
        # such an item then fails alone, with one line, when it is opened.
        if os.path.isdir(path):
            pairs = _folder_files(path, recursive, notes, found)
            yield from pairs if pairs else [(item, None)]
        elif os.path.lexists(path) or not glob.has_magic(item):
            yield item, path
        else:
            pairs = _glob_files(item, recursive, notes, found)
            yield from pairs if pairs else [(item, None)]


def _folder_files(folder: Path, recursive: bool, notes: list[tuple[str, Note]] | None,
                  found: Found | None) -> list[tuple[str, Path]]:
    checkpoint = dcp_checkpoint(folder, notes)
    if checkpoint is not None:  # a DCP checkpoint: its .metadata stands for the folder
        if found is not None and checkpoint.name == METADATA_NAME:  # (its other files, Megatron's
            found.weights[checkpoint] = checkpoint.parent          # metadata.json, go along into --out-dir)
        return [(str(folder), checkpoint)]
    indexes = folder_indexes(folder, notes)
    if indexes:
        return [(str(index), index) for index in indexes]
    listed = sorted(folder.rglob("*") if recursive else folder.iterdir(), key=lambda p: _natural(str(p)))
    # a DCP checkpoint inside (checkpoint/step-100/) counts as one file: its .metadata (with -r,
    # every DCP folder below is found itself: a NeMo or Accelerate folder is not looked into)
    inner = {p: _standing(p) if recursive else dcp_checkpoint(p, notes) for p in listed if p.is_dir()}
    files = _holding_tensors(fold_pieces([inner.get(p) or p for p in listed
                                          if inner.get(p) is not None or p.is_file() and is_tensor_file(p)]),
                             notes)
    weights = folder / SAFETENSORS_SINGLE
    if found is not None and weights in files:
        found.weights[weights] = folder
    return [(str(p), p) for p in files]


def _standing(path: Path) -> Path | None:
    """What stands for a DCP folder (its ``.metadata``; see :func:`standing_for`), else None."""
    return path / METADATA_NAME if is_dcp_folder(path) else standing_for(path)


def dcp_checkpoint(folder: Path, notes: list[tuple[str, Note]] | None = None) -> Path | None:
    """What stands for a DCP checkpoint folder: its ``.metadata``; a Megatron folder's
    ``metadata.json`` where it has no ``.metadata`` (a zarr checkpoint: its reader refuses it);
    the ``.metadata`` of a NeMo 2 checkpoint's ``weights/`` or of Accelerate's
    ``pytorch_model_fsdp_0/`` (the optimizer's folder beside it left, with a note). None for
    any other folder."""
    if is_dcp_folder(folder):
        return folder / METADATA_NAME
    standing = standing_for(folder)  # a DCP checkpoint saved per rank
    if standing is not None:
        return standing
    if is_megatron_folder(folder):
        return folder / MEGATRON_CONFIG
    found = inner_checkpoint(folder)
    if found is None:
        return None
    inner, left = found
    if left and notes is not None:
        notes.append((str(folder), Note(NoteKind.FOLDER_WEIGHTS, (
            f"holds the model's checkpoint {inner.name}/ beside {name_list([p.name + '/' for p in left], 3)}; "
            f"reading {inner.name}/ (name a folder to read it)"))))
    return inner / METADATA_NAME


def _glob_files(pattern: str, recursive: bool, notes: list[tuple[str, Note]] | None,
                found: Found | None) -> list[tuple[str, Path]]:
    pairs: list[tuple[str, Path]] = []
    for match in sorted(glob.glob(pattern, recursive=recursive), key=_natural):
        path = Path(match)
        if os.path.isdir(path):
            pairs += _folder_files(path, recursive, notes, found)
        elif path.name.endswith(INDEX_SUFFIX) and path.is_file():
            pairs.append((str(path), path))
        elif path.is_file() and is_tensor_file(path):
            pairs += [(str(p), p) for p in _holding_tensors([path], notes)]
    # every per-rank piece of a DCP Hugging Face folder the glob matches: that folder, once
    folded = fold_pieces([path for _, path in pairs])
    if len(folded) != len(pairs):
        names = {os.path.normpath(path): name for name, path in pairs}
        pairs = [(names.get(os.path.normpath(path), str(path)), path) for path in folded]
    # a shard of a set the glob also gave (its index, its folder) is that set's, not a file of its own
    covered: set[str] = set()
    for _, path in pairs:
        if path.name.endswith(INDEX_SUFFIX):
            try:
                covered.update(os.path.normpath(f) for f in load_index(path).files)
            except (TclipError, OSError):
                pass  # reported when the index is read
    once: dict[str, tuple[str, Path]] = {}
    for name, path in pairs:
        if os.path.normpath(path) not in covered:
            once.setdefault(os.path.normpath(path), (name, path))  # (a ** glob matches a folder and its files)
    return list(once.values())


def _holding_tensors(files: list[Path], notes: list[tuple[str, Note]] | None) -> list[Path]:
    """``files`` but those that hold no tensors tclip reads (pickled Python objects only:
    a Trainer's ``rng_state.pth``), each with a note; a file that fails otherwise stays,
    to fail on its own turn."""
    kept = []
    for path in files:
        error = no_tensors(path)
        if error is None:
            kept.append(path)
            continue
        if notes is not None:
            notes.append((str(path), Note(NoteKind.NO_TENSORS, f"{error.detail}; left out")))
    return kept


def no_tensors(path: Path) -> NoTensorsError | None:
    """Why a PyTorch file holds no tensors tclip reads (pickled Python objects only), or None
    (it holds some, or is no such file, or fails otherwise: that is for its reader to say)."""
    try:
        if detect_format(path) == pytorch.NAME:
            open_reader(path).close()
    except NoTensorsError as error:
        return error
    except TclipError:
        pass
    return None


def diff_input(item: str, notes: list[tuple[str, Note]] | None = None) -> str:
    """A side of ``diff``: a file, an index, or a folder as the other commands take it: its
    index (a safetensors one preferred: :func:`folder_indexes`), else its ``model.safetensors``
    (as ``from_pretrained`` loads it, a Trainer's optimizer.pt beside it left), else its one
    tensor file."""
    path = Path(item)
    if not os.path.isdir(path):
        return item
    checkpoint = dcp_checkpoint(path, notes)
    if checkpoint is not None:
        return str(checkpoint)
    indexes = folder_indexes(path, notes)
    if len(indexes) == 1:
        return str(indexes[0])
    if indexes:
        raise TclipError(f"holds {len(indexes)} indexes ({', '.join(p.name for p in indexes)}); name one", item)
    files = [p for _, p in _folder_files(path, False, [], None)]  # (what it leaves out is not compared anyway)
    weights = path / SAFETENSORS_SINGLE
    if weights in files:
        left = [p.name for p in files if p != weights]
        if left and notes is not None:
            notes.append((item, Note(NoteKind.FOLDER_WEIGHTS, (
                f"holds {SAFETENSORS_SINGLE} beside {name_list(left, 3)}; comparing {SAFETENSORS_SINGLE} (the "
                "weights from_pretrained loads) and leaving the others"))))
        return str(weights)
    if len(files) == 1:
        return str(files[0])
    if not files:
        raise TclipError("is a directory without tensor files; name a file or an index", item)
    raise TclipError(f"holds {len(files)} tensor files ({name_list([p.name for p in files], 3)}); name one", item)


def _natural(text: str) -> list[Any]:
    return natural_key(text)
