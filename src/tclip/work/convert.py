"""``convert``: any tensor set tclip reads, written in another format, values unchanged.

A destination with a tensor file suffix is one file of that format; any other destination
is a folder in the layout ``save_pretrained`` writes: ``model.safetensors`` when everything
fits in one shard, else ``model-00001-of-0000N.safetensors`` shards and
``model.safetensors.index.json`` (``metadata.total_size``, ``weight_map``), with the
source folder's config and tokenizer files copied beside them as ``--out-dir`` does.

Every output file is written by the writers the clipping commands use (through
:func:`~tclip.work.rewrite.rewrite_file` with no work: each tensor is copied in blocks, or
byte for byte in the kernel where the source holds it as one run), so memory stays within
the budget whatever the checkpoint's size, and each file appears atomically. A run that
fails removes what it wrote and leaves the destination as it found it.

Left out unless an include pattern names them: a training optimizer's state (the tensors
the readers mark as such, as ``report`` leaves them out of the global norm) and the items a
DCP folder saved as pickled objects (step, lr, scheduler and dataloader states); the result
says what was left out.
"""

from __future__ import annotations

import json
import os
import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import OutputExistsError, TclipError, UnsupportedError
from ..formats import TensorInfo, TensorReader, open_reader
from ..formats.atomic import remove_if_same, write_json
from ..formats.dcp import METADATA_NAME, is_dcp_folder
from ..formats.dcp.layouts import COMMON_STATE, MEGATRON_CONFIG
from ..formats.dcp.per_rank import checkpoint_files
from ..formats.locks import shared_locks
from ..formats.registry import holds_metadata, output_format, suffixes
from ..formats.sharded import INDEX_SUFFIX, SetReader, TensorSet, is_index, resolve
from ..messages import Message, Naming, Option, library_name
from ..text import name_list
from .budget import Budget
from .companions import Companions, companions, copy_companions, folder_companions
from .inputs import diff_input, is_tensor_file
from .rewrite import carried_loss, rewrite_file
from .results import Note, NoteKind
from .selection import Selection

DEFAULT_SHARD_SIZE = "5GB"  # transformers' save_pretrained default
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
SHARD_NAME = "model-{:05d}-of-{:05d}.safetensors"

# As huggingface_hub parses max_shard_size: KB/MB/GB/TB are powers of ten, KiB/MiB/GiB/TiB of two.
_SIZE_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
               "KIB": 1 << 10, "MIB": 1 << 20, "GIB": 1 << 30, "TIB": 1 << 40}


def parse_shard_size(value: str | int) -> int:
    """``--max-shard-size`` as ``save_pretrained`` reads it: ``"5GB"`` is 5·10⁹ bytes,
    ``"2GiB"`` 2·2³⁰, a plain number is bytes. Raises ValueError for anything else."""
    if isinstance(value, int) and not isinstance(value, bool):
        size = value
    else:
        match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([A-Za-z]*)\s*", str(value))
        unit = match[2].upper() if match else ""
        if not match or unit not in _SIZE_UNITS:
            raise ValueError(f"{value!r} is not a size (e.g. 5GB, 500MB, 2GiB or a number of bytes)")
        size = int(float(match[1]) * _SIZE_UNITS[unit])
    if size < 1:
        raise ValueError(f"{value!r} must be at least one byte")
    return size


@dataclass
class ConvertResult:
    """What one conversion wrote, as plain data."""

    source: str
    target: str
    format: str  # the output format
    files: list[str] = field(default_factory=list)  # tensor files written, in order
    index: str | None = None  # the index written (a folder of several shards)
    tensors: int = 0
    bytes_written: int = 0  # of the tensor files
    left_out: list[str] = field(default_factory=list)  # tensors and items left out by default
    copied: list[str] = field(default_factory=list)  # side files copied (config, tokenizer)
    not_copied: list[tuple[str, str]] = field(default_factory=list)  # (name, why)
    warnings: list[Note] = field(default_factory=list)
    elapsed_s: float = 0.0

    def to_json(self, name: Naming = library_name) -> dict[str, Any]:
        return {"schema": 1, "command": "convert", "file": self.source, "output": self.target,
                "format": self.format, "files": self.files, "index": self.index, "tensors": self.tensors,
                "bytes_written": self.bytes_written, "left_out": self.left_out, "copied": self.copied,
                "not_copied": [{"name": n, "reason": why} for n, why in self.not_copied],
                "warnings": [w.spelled(name) for w in self.warnings], "elapsed_s": round(self.elapsed_s, 6)}


class _Subset(TensorReader):
    """Some tensors of a source, as a reader of their own (one output file's share)."""

    def __init__(self, source: TensorReader, tensors: list[TensorInfo], metadata: dict[str, Any],
                 others: list[Any]) -> None:
        super().__init__(source.path)
        self.source = source
        self.format_name = source.format_name
        self.damage = source.damage
        self.tensors = {t.name: t for t in tensors}
        self.metadata = metadata
        self.others = others

    def read(self, name: str, index: Any = None, scratch: Any = None) -> Any:
        return self.source.read(name, index, scratch)

    def read_flat(self, name: str, start: int, stop: int, out: Any = None) -> Any:
        return self.source.read_flat(name, start, stop, out)

    def read_part(self, name: str, start: int, stop: int, out: Any = None) -> Any:
        return self.source.read_part(name, start, stop, out)

    def part_parallel_safe(self, name: str) -> bool:
        return self.source.part_parallel_safe(name)

    def region(self, name: str) -> tuple[int, int] | None:
        return self.source.region(name)

    def runs(self, name: str) -> list[tuple[int, int, int, int]] | None:
        return self.source.runs(name)

    def parallel_safe(self, name: str) -> bool:
        return self.source.parallel_safe(name)

    def align(self, name: str) -> int:
        return self.source.align(name)

    def blocks(self, name: str, max_bytes: int = 8 << 20) -> Any:
        return self.source.blocks(name, max_bytes)

    def stored_bytes(self, name: str, chunk: int = 1 << 20) -> Any:
        return self.source.stored_bytes(name, chunk)

    def lost_in_conversion(self) -> list[str]:
        return self.source.lost_in_conversion()

    def lossy_filters(self) -> dict[str, str]:
        return {n: f for n, f in self.source.lossy_filters().items() if n in self.tensors}


def plan_shards(tensors: list[TensorInfo], max_bytes: int) -> list[list[TensorInfo]]:
    """Tensors into shards by ``save_pretrained``'s rule: in order, a new shard when adding a
    tensor would pass ``max_bytes``; a tensor larger than that alone in a shard of its own."""
    shards: list[list[TensorInfo]] = []
    current: list[TensorInfo] = []
    size = 0
    for info in tensors:
        if info.nbytes > max_bytes:
            shards.append([info])
            continue
        if current and size + info.nbytes > max_bytes:
            shards.append(current)
            current, size = [], 0
        current.append(info)
        size += info.nbytes
    if current or not shards:
        shards.append(current)
    return shards


def is_file_target(target: Path) -> bool:
    """Whether ``target`` names one tensor file (its suffix is a format's), not a folder."""
    return not os.path.isdir(target) and any(str(target).lower().endswith(s) for s in suffixes())


def convert(source: Path | str, target: Path | str, *, selection: Selection | None = None,
            max_shard_size: str | int = DEFAULT_SHARD_SIZE, overwrite: bool = False,
            drop_nonnumeric: bool = False, budget: Budget | None = None) -> ConvertResult:
    """Write the tensors of ``source`` (a file, an index, a folder as ``diff`` takes it, a DCP
    folder) to ``target``: one file of its suffix's format, or a Hugging Face style folder.

    Args:
        selection: include/exclude globs; optimizer state and a DCP folder's pickled items
            are left out unless an include pattern names them.
        max_shard_size: a folder's largest shard (``save_pretrained``'s rule, "5GB" = 5·10⁹).
        overwrite: replace existing outputs (else an existing ``target`` is refused).
        drop_nonnumeric: drop what the output format cannot hold, with a warning (else refused).

    Returns:
        A :class:`ConvertResult`.
    """
    started = time.perf_counter()
    selection = selection or Selection()
    budget = budget or Budget()
    shard_bytes = parse_shard_size(max_shard_size)
    target = Path(target)
    _check_target(Path(source), target, overwrite)
    chosen = Path(diff_input(os.fspath(source)))
    with shared_locks([chosen] if is_index(chosen) else []):  # (a set never half rewritten in place meanwhile)
        return _convert(source, chosen, target, selection, shard_bytes, overwrite, drop_nonnumeric, budget, started)


def _convert(source: Path | str, chosen: Path, target: Path, selection: Selection, shard_bytes: int,
             overwrite: bool, drop_nonnumeric: bool, budget: Budget, started: float) -> ConvertResult:
    tensor_set = resolve(TensorSet(str(chosen), [], chosen)) if is_index(chosen) else None
    with (SetReader(tensor_set) if tensor_set is not None else open_reader(chosen)) as reader:
        if reader.damage is not None:
            raise TclipError(reader.damage, reader.path)
        as_file = is_file_target(target)
        kind = output_format(target, reader) if as_file else "safetensors"
        result = ConvertResult(str(source), str(target), kind or "?")
        kept, others, metadata = _choose(reader, selection, result)
        whole = _Subset(reader, kept, metadata, others)
        lost = carried_loss(whole, target if as_file else target / SINGLE_FILE)
        if lost:
            listing = name_list(lost, 8)
            if not drop_nonnumeric:
                raise UnsupportedError((f"{kind} cannot hold {listing}; nothing was written (",
                                        Option.DROP_NONNUMERIC, " drops them with a warning)"), reader.path)
            result.warnings.append(Note(NoteKind.DROPPED, f"dropped what the output format cannot hold: {listing}"))
            kept = [t for t in kept if t.numeric and t.encoding is None]
            if not holds_metadata(kind or ""):
                metadata = {}
        if not kept:
            raise TclipError(("no tensor to write (", Option.INCLUDE, " names what was left out)"), reader.path)
        result.tensors = len(kept)
        written: list[tuple[Path, tuple[int, int, int]]] = []
        made_folder = False
        try:
            if as_file:
                _write_file(whole, kept, metadata, target, overwrite, budget, result, written)
            else:
                made_folder = _make_folder(target)
                _write_folder(whole, kept, metadata, target, shard_bytes, overwrite, budget, result, written,
                              _side_files(Path(source), chosen, tensor_set, target, reader))
        except BaseException:
            for path, identity in reversed(written):
                remove_if_same(path, identity)
            if made_folder:
                try:
                    os.rmdir(target)
                except OSError:
                    pass
            raise
    result.elapsed_s = time.perf_counter() - started
    return result


def _check_target(source: Path, target: Path, overwrite: bool) -> None:
    """Refuse, before anything is read or written, a target inside the source folder or the
    source itself, and an existing target without ``overwrite``."""
    # An index or a DCP .metadata stands for its folder: the set is the folder's files.
    root = source.parent if is_index(source) or source.name == METADATA_NAME else source
    real_source, real_target = os.path.realpath(root), os.path.realpath(target)
    if real_target == real_source or (os.path.isdir(root) and real_target.startswith(real_source + os.sep)):
        raise TclipError(f"the output {target} is inside the input; write it elsewhere", source)
    if os.path.lexists(target) and not overwrite:
        raise OutputExistsError(("output already exists; pass ", Option.FORCE, " to replace it"), target)
    if os.path.lexists(target) and not is_file_target(target) and not os.path.isdir(target):
        raise TclipError("exists and is not a folder (a file's suffix names its format)", target)


def _choose(reader: TensorReader, selection: Selection,
            result: ConvertResult) -> tuple[list[TensorInfo], list[Any], dict[str, Any]]:
    """The tensors and objects to write, and the file metadata to carry; what is left out
    by default goes to ``result.left_out`` (with a note)."""
    kept, left = [], []
    for name, info in reader.tensors.items():
        if not selection.matches(name):
            continue
        if info.optimizer_state and not selection.names_explicitly(name):
            left.append(name)
            continue
        kept.append(info)
    dcp = reader.format_name == "dcp"
    others = []
    for other in reader.others:
        if not selection.matches(other.name):
            continue
        if dcp and not selection.names_explicitly(other.name):
            left.append(other.name)  # a pickled training object (lr, step, scheduler state): no weight
            continue
        others.append(other)
    # A DCP folder's metadata describes the checkpoint's container; an index's total_size its files.
    metadata = {} if dcp else {k: v for k, v in reader.metadata.items()
                               if not (isinstance(reader, SetReader) and k == "total_size")}
    result.left_out = left
    if left:
        optimizer = sum(1 for n in left if n in reader.tensors)
        parts = [f"{optimizer:,} optimizer state tensor{'s' if optimizer != 1 else ''}"] if optimizer else []
        if len(left) > optimizer:
            objects = len(left) - optimizer
            parts.append(f"{objects:,} item{'s' if objects != 1 else ''} saved as objects (not tensors)")
        excludes: list[str | Option] = []
        for pattern in left_patterns(left, [t.name for t in kept]):
            excludes += [" " if excludes else "", Option.EXCLUDE, f" {pattern!r}"]
        message: Message = (f"left out {' and '.join(parts)}: {name_list(left)}; name them with ", Option.INCLUDE,
                            " to convert them too (a diff of the input against the output names them as only in "
                            "the input; ", *excludes, " compares the rest)")
        result.warnings.append(Note(NoteKind.OPTIMIZER_STATE, message))
    for pattern in selection.unmatched([*reader.tensors, *(o.name for o in reader.others)]):
        result.warnings.append(Note(NoteKind.UNMATCHED_PATTERN, f"pattern {pattern!r} matches no tensor"))
    return kept, others, metadata


def left_patterns(left: list[str], kept: list[str]) -> list[str]:
    """Globs matching exactly the names ``left`` out and none ``kept``: ``optimizer.*`` for a
    first name part all of whose names were left out, else the names themselves."""
    first = {name.split(".", 1)[0] for name in kept}
    groups: dict[str, list[str]] = {}
    for name in left:
        groups.setdefault(name.split(".", 1)[0], []).append(name)
    out = []
    for head, names in groups.items():
        whole = head not in first and len(names) > 1 and all("." in n for n in names)
        out += [f"{head}.*"] if whole else names
    return out


def _portable(metadata: dict[str, Any]) -> dict[str, str]:
    return {str(k): v if isinstance(v, str) else json.dumps(v, default=str) for k, v in metadata.items()}


def _write_one(whole: _Subset, tensors: list[TensorInfo], metadata: dict[str, Any], path: Path, overwrite: bool,
               budget: Budget, result: ConvertResult, written: list[tuple[Path, tuple[int, int, int]]]) -> None:
    part = _Subset(whole.source, tensors, {}, [])
    kind = output_format(path, part)
    carried = _portable(metadata) if metadata and holds_metadata(kind or "") else None
    done = rewrite_file(part, {}, path, overwrite=overwrite, budget=budget, metadata=carried, measure_after=False)
    if done.written is not None:
        written.append((path, done.written))
    result.files.append(str(path))
    result.bytes_written += done.bytes_written
    result.warnings += done.warnings


def _write_file(whole: _Subset, kept: list[TensorInfo], metadata: dict[str, Any], target: Path, overwrite: bool,
                budget: Budget, result: ConvertResult, written: list[tuple[Path, tuple[int, int, int]]]) -> None:
    _write_one(whole, kept, metadata, target, overwrite, budget, result, written)


def _make_folder(target: Path) -> bool:
    """Create the output folder (and its parents); whether this run created it."""
    if os.path.isdir(target):
        return False
    try:
        target.mkdir(parents=True)
    except OSError as error:
        raise TclipError(f"cannot create the folder ({error.strerror or error}); nothing was written", target) from None
    return True


def _write_folder(whole: _Subset, kept: list[TensorInfo], metadata: dict[str, Any], target: Path,
                  shard_bytes: int, overwrite: bool, budget: Budget, result: ConvertResult,
                  written: list[tuple[Path, tuple[int, int, int]]], sides: Companions) -> None:
    shards = plan_shards(kept, shard_bytes)
    names = [SINGLE_FILE] if len(shards) == 1 else [SHARD_NAME.format(i + 1, len(shards)) for i in range(len(shards))]
    targets = [target / n for n in [*names, *([INDEX_FILE] if len(shards) > 1 else [])]] \
        + [t for _, t in sides.copies]
    for path in targets:  # before anything is written
        if not overwrite and os.path.lexists(path):
            raise OutputExistsError(("output already exists; pass ", Option.FORCE, " to replace it"), path)
    # Weights this run would not replace would sit beside its own: a loader could take them.
    stale = sorted(name for name in os.listdir(target) if target / name not in targets
                   and (name.endswith(INDEX_SUFFIX) or is_tensor_file(target / name)))
    if stale:
        raise TclipError(f"holds {name_list(stale, 3)}, which this conversion would not replace (a loader could "
                         "take them for its output); remove them or write to another folder", target)
    for name, tensors in zip(names, shards):
        # save_pretrained marks its shards as PyTorch's; a source's own metadata is carried instead
        _write_one(whole, tensors, metadata or {"format": "pt"}, target / name, overwrite, budget, result, written)
    identities: dict[Path, tuple[int, int, int]] = {}
    try:
        result.copied = [t.name for t in copy_companions(sides.copies, overwrite, identities)]
    finally:
        written += list(identities.items())
    result.not_copied = list(sides.left)
    if len(shards) > 1:
        index_metadata = {**_portable(metadata), "total_size": sum(t.nbytes for t in kept)} if metadata \
            else {"total_size": sum(t.nbytes for t in kept)}
        data = {"metadata": index_metadata,
                "weight_map": {t.name: name for name, tensors in zip(names, shards) for t in tensors}}
        index = target / INDEX_FILE
        identity = write_json(index, data, None, overwrite=overwrite)
        if identity is not None:
            written.append((index, identity))
        result.index = str(index)


def _side_files(source: Path, chosen: Path, tensor_set: TensorSet | None, target: Path,
                reader: TensorReader) -> Companions:
    """The config and tokenizer files to copy beside the output (as ``--out-dir`` copies them):
    those of the index's folder, or of the folder given as the source; none for a file."""
    if tensor_set is not None and tensor_set.index is not None:
        found = companions(tensor_set, target)
    elif os.path.isdir(source):
        taken = [chosen]
        if is_dcp_folder(source):  # (Megatron's metadata.json and common.pt are the checkpoint's, not side files:
            # a metadata.json beside safetensors would make Megatron take the output for a torch_dist checkpoint)
            taken = [source / METADATA_NAME, *sorted(source.glob("*.distcp")), source / MEGATRON_CONFIG,
                     source / COMMON_STATE]
        taken += checkpoint_files(source)  # (a DCP folder saved per rank)
        found = folder_companions(source, target, taken)
    else:
        return Companions()
    return found


__all__ = ["ConvertResult", "DEFAULT_SHARD_SIZE", "convert", "left_patterns", "parse_shard_size", "plan_shards"]
