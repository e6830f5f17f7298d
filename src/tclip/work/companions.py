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
import re
import shutil
import stat
from collections.abc import Collection
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO

from ..core.dtypes import is_floating
from ..errors import OutputExistsError, TclipError
from ..formats import torch as pytorch
from ..formats.atomic import TEMP_SUFFIX, AtomicOutput
from ..formats.dcp import METADATA_NAME
from ..formats.locks import LOCK_SUFFIX
from ..formats.registry import detect_format, open_reader
from ..formats.sharded import INDEX_SUFFIX, TensorSet
from ..messages import Option
from ..text import natural_key
from .inputs import is_tensor_file, no_tensors
from .journal import JOURNAL_SUFFIX, MARKER_SUFFIX
from .results import FileReport

OWN_SUFFIXES = (TEMP_SUFFIX, JOURNAL_SUFFIX, MARKER_SUFFIX, LOCK_SUFFIX)


# Weights in formats tclip does not read, which Hugging Face repositories ship beside the
# safetensors shards (Flax's flax_model.msgpack, rust-bert's rust_model.ot, ONNX, TF Lite,
# Keras, PaddlePaddle, Core ML, TensorFlow checkpoints): copied beside clipped shards they
# would be unclipped weights a loader could take (tf_model.h5 is HDF5: a tensor file already).
OTHER_WEIGHTS = (".msgpack", ".ot", ".onnx", ".tflite", ".keras", ".pdparams", ".mlmodel", ".ckpt", ".ckpt.index")
_CHECKPOINT_DATA = re.compile(r".+\.data-[0-9]+-of-[0-9]+$")  # a TensorFlow checkpoint's data shards


def other_weights(name: str) -> bool:
    """Whether a file name is one of weights in a format tclip does not read."""
    lower = name.lower()
    return lower.endswith(OTHER_WEIGHTS) or bool(_CHECKPOINT_DATA.match(lower))


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
        elif entry.name.endswith(INDEX_SUFFIX) or is_tensor_file(path) or other_weights(entry.name):
            found.left.append((entry.name, "weights tclip did not clip"))
        else:
            found.copies.append((path, Path(out_dir) / entry.name))
    return found


def copy_companions(copies: list[tuple[Path, Path]], overwrite: bool,
                    written: dict[Path, tuple[int, int, int]] | None = None) -> list[Path]:
    """Copy each file atomically (a temporary file, fsynced, renamed); the targets written
    (and, in ``written``, each one's identity: see :func:`tclip.formats.atomic.file_identity`)."""
    done = []
    for source, target in copies:
        output = AtomicOutput(target, overwrite=overwrite, mode_from=source)
        try:
            with _open_regular(source) as reader, os.fdopen(output.open(), "wb") as writer:
                shutil.copyfileobj(reader, writer, 1 << 20)
            output.commit()
        except BaseException:
            output.abort()
            raise
        done.append(target)
        if written is not None and output.written is not None:
            written[target] = output.written
    return done


def _open_regular(source: Path) -> BinaryIO:
    """``source`` opened for reading as inputs are: a link is followed (a Hugging Face
    snapshot's files are links), but what it names must be a regular file now, when it
    is copied (a FIFO put there since the folder was listed would block the run forever;
    O_NONBLOCK opens it without waiting for a writer, and it is refused)."""
    try:
        fd = os.open(source, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0))
    except OSError as error:
        raise TclipError(f"cannot copy it ({error.strerror or error}); nothing was written", source) from None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise TclipError("is no longer a regular file (a FIFO, device or socket is never read); nothing was "
                             "written", source)
        if hasattr(os, "set_blocking"):
            os.set_blocking(fd, True)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def folder_companions(folder: Path, out_dir: Path, taken: Collection[Path]) -> Companions:
    """The other files of a folder that its ``model.safetensors`` stands for (``save_pretrained``'s,
    a Trainer's ``checkpoint-100/``), to copy beside that file's output in ``out_dir``, as for an
    index: ``from_pretrained(OUT)`` needs config.json. The run's inputs (``taken``: the weights,
    and optimizer.pt written as a set of its own) are not copied and not listed; nor are a DCP
    folder's ``.distcp`` files, which the run writes with its ``.metadata``."""
    own = list(taken)
    if Path(folder) / METADATA_NAME in own:
        own += sorted(Path(folder).glob("*.distcp"))
    return with_plain_files(companions(TensorSet(str(folder), own), out_dir, folder), folder, out_dir)


def with_plain_files(found: Companions, folder: Path, out_dir: Path) -> Companions:
    """``found`` with the files it leaves as weights that hold no tensors tclip reads (a Trainer's
    ``rng_state.pth`` and ``training_args.bin``: pickled Python objects) copied instead: they
    are no weights, and a checkpoint resumed from the output folder needs them."""
    moved = [name for name, _ in found.left if _no_weights(Path(folder) / name)]
    if not moved:
        return found
    copies = [*found.copies, *((Path(folder) / n, Path(out_dir) / n) for n in moved)]
    return Companions(sorted(copies, key=lambda pair: natural_key(pair[0].name)),
                      [(name, why) for name, why in found.left if name not in moved])


def _no_weights(path: Path) -> bool:
    """Whether a PyTorch file holds no weights: no tensors tclip reads (pickled Python objects),
    or no floating-point tensor among those it reads (a scheduler's state_dict of numbers, an
    RNG state's uint8 tensor)."""
    if no_tensors(path) is not None:
        return True
    try:
        if detect_format(path) != pytorch.NAME:
            return False
        with open_reader(path) as reader:
            return not any(is_floating(info.dtype) for info in reader.tensors.values())
    except TclipError:
        return False


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
