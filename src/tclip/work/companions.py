"""The other files of a checkpoint's folder, copied beside a set written with ``--out-dir``.

``save_pretrained`` puts ``config.json``, ``generation_config.json``, the tokenizer's
files and a model card beside the shards and the index; ``from_pretrained(OUT)`` needs
them. Copied: every regular file of the index's folder (a symlink counts by what it
points to: a Hugging Face cache's snapshot) except the index, the shards it names,
tclip's own temporary, journal and marker files, and weights tclip did not clip (other
tensor files and indexes: copying unclipped weights beside clipped ones would let a
loader pick the wrong ones). Subfolders are not copied (shards in one are written by
the run itself). Each copy is atomic, like every output."""

from __future__ import annotations

import os
import shutil
import stat
from collections.abc import Collection
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import OutputExistsError
from ..formats.atomic import TEMP_SUFFIX, AtomicOutput
from ..formats.sharded import INDEX_SUFFIX, TensorSet
from ..messages import Option
from ..text import natural_key
from .inputs import is_tensor_file, no_tensors
from .journal import JOURNAL_SUFFIX, MARKER_SUFFIX
from .results import FileReport

OWN_SUFFIXES = (TEMP_SUFFIX, JOURNAL_SUFFIX, MARKER_SUFFIX)


@dataclass
class Companions:
    """What goes with a set into its output folder: files to copy (source, target) and
    what the folder holds that is not copied (name, why)."""

    copies: list[tuple[Path, Path]] = field(default_factory=list)
    left: list[tuple[str, str]] = field(default_factory=list)


def companions(tensor_set: TensorSet, out_dir: Path, folder: Path | None = None) -> Companions:
    """The files of the set's index folder (of ``folder`` for a set without an index) to copy
    into ``out_dir``, in natural order."""
    if folder is None:
        assert tensor_set.index is not None
        folder = tensor_set.index.parent
    own = {os.path.normpath(f) for f in [*tensor_set.files, *([tensor_set.index] if tensor_set.index else [])]}
    found = Companions()
    try:
        entries = sorted(os.scandir(folder), key=lambda e: natural_key(e.name))
    except OSError:
        return found
    for entry in entries:
        path = Path(folder) / entry.name
        if os.path.normpath(path) in own or entry.name.endswith(OWN_SUFFIXES):
            continue
        try:
            st = os.stat(path)  # a link counts by what it points to
        except OSError:
            found.left.append((entry.name, "a broken link"))
            continue
        if stat.S_ISDIR(st.st_mode):
            if not any(Path(f).is_relative_to(path) for f in tensor_set.files):
                found.left.append((entry.name + "/", "a folder"))
        elif not stat.S_ISREG(st.st_mode):
            found.left.append((entry.name, "not a regular file"))
        elif entry.name.endswith(INDEX_SUFFIX) or is_tensor_file(path):
            found.left.append((entry.name, "weights tclip did not clip"))
        else:
            found.copies.append((path, Path(out_dir) / entry.name))
    return found


def copy_companions(copies: list[tuple[Path, Path]], overwrite: bool) -> list[Path]:
    """Copy each file atomically (a temporary file, fsynced, renamed); the targets written."""
    written = []
    for source, target in copies:
        output = AtomicOutput(target, overwrite=overwrite, mode_from=source)
        try:
            with open(source, "rb") as reader, os.fdopen(output.open(), "wb") as writer:
                shutil.copyfileobj(reader, writer, 1 << 20)
            output.commit()
        except BaseException:
            output.abort()
            raise
        written.append(target)
    return written


def folder_companions(folder: Path, out_dir: Path, taken: Collection[Path]) -> Companions:
    """The other files of a folder that its ``model.safetensors`` stands for (``save_pretrained``'s,
    a Trainer's ``checkpoint-100/``), to copy beside that file's output in ``out_dir``, as for an
    index: ``from_pretrained(OUT)`` needs config.json. The run's inputs (``taken``: the weights,
    and optimizer.pt written as a set of its own) are not copied and not listed."""
    return with_plain_files(companions(TensorSet(str(folder), list(taken)), out_dir, folder), folder, out_dir)


def with_plain_files(found: Companions, folder: Path, out_dir: Path) -> Companions:
    """``found`` with the files it leaves as weights that hold no tensors tclip reads (a Trainer's
    ``rng_state.pth`` and ``training_args.bin``: pickled Python objects) copied instead: they
    are no weights, and a checkpoint resumed from the output folder needs them."""
    moved = [name for name, _ in found.left if no_tensors(Path(folder) / name) is not None]
    if not moved:
        return found
    copies = [*found.copies, *((Path(folder) / n, Path(out_dir) / n) for n in moved)]
    return Companions(sorted(copies, key=lambda pair: natural_key(pair[0].name)),
                      [(name, why) for name, why in found.left if name not in moved])


def check_copy_targets(found: Companions, overwrite: bool) -> None:
    """Refuse, before anything is written, copies whose targets exist (unless ``overwrite``)."""
    for _, target in found.copies:
        if not overwrite and os.path.lexists(target):
            raise OutputExistsError(("output already exists; pass ", Option.FORCE, " to replace it"), target)


def copy_into_report(report: FileReport, found: Companions, dry_run: bool, overwrite: bool) -> None:
    """Copy the files (a dry run only lists them) and say so in ``report``."""
    if dry_run:
        report.would_copy = [{"file": str(f), "output": str(t), "exists": os.path.lexists(t)} for f, t in found.copies]
    else:
        copy_companions(found.copies, overwrite)
        report.copied = [source.name for source, _ in found.copies]
    report.not_copied = [{"name": name, "reason": why} for name, why in found.left]
