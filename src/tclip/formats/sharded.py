"""Sharded checkpoints: index files (``model.safetensors.index.json``), GGUF split sets and one
reader over a set.

A set is either the shards an index names (its ``weight_map`` maps every tensor
to its shard, as ``save_pretrained`` and PyTorch's Hugging Face storage writer
write it), the files of a GGUF split set (``model-00001-of-00003.gguf`` ...: any one
of them stands for the set, as an index does; llama.cpp finds the others by that
name pattern, and the ``split.*`` keys of each say which it is), or a list of files
(``--across-files``). An index is data from the file
system, so it is checked like any file: JSON without duplicate keys, shard names
inside the index's folder, every listed tensor present in its shard and no tensor
in two shards."""

from __future__ import annotations

import functools
import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import FormatError, TclipError
from ..text import natural_key
from .atomic import write_json
from .base import TensorReader
from .dcp.per_rank import is_hf_shards_folder
from .registry import open_reader

INDEX_SUFFIX = ".index.json"


MAX_INDEX_BYTES = 256 << 20


IN_PROGRESS_KEY = "tclip_in_progress"


# llama.cpp's llama_split_path: PREFIX-%05d-of-%05d.gguf, numbered from 1
GGUF_SPLIT_NAME = re.compile(r"(?P<prefix>.+)-(?P<no>[0-9]{5})-of-(?P<count>[0-9]{5})\.gguf", re.IGNORECASE)


def is_index(path: Path | None) -> bool:
    """Whether ``path`` stands for a set: an index file, or one file of a GGUF split set."""
    if path is None:
        return False
    path = Path(path)
    if path.name.endswith(INDEX_SUFFIX):
        return path.is_file()
    return is_gguf_split(path)


def is_gguf_split(path: Path) -> bool:
    """A GGUF file whose ``split.count`` is above 1 (an unreadable file is not: it fails when opened)."""
    if Path(path).suffix.lower() != ".gguf":
        return False
    try:
        st = os.stat(path)
    except OSError:
        return False
    return _gguf_split(str(path), st.st_ino, st.st_mtime_ns, st.st_size) is not None


@functools.lru_cache(maxsize=256)
def _gguf_split(path: str, inode: int, mtime: int, size: int) -> tuple[int, int] | None:
    """(split.no, split.count) of a GGUF file of a split set, else None (cached per file version:
    every input is asked more than once)."""
    from .gguf.header import parse_gguf

    try:
        split = parse_gguf(path).split
    except (TclipError, OSError):
        return None
    if split is None or split.count <= 1:
        return None
    return split.no, split.count


def set_anchor(path: Path) -> Path:
    """The file that names a set: an index itself, a GGUF split set's first file (so that a glob
    or a folder of its files gives the set once)."""
    path = Path(path)
    match = GGUF_SPLIT_NAME.fullmatch(path.name)
    if match is None or not is_gguf_split(path):
        return path
    st = os.stat(path)
    split = _gguf_split(str(path), st.st_ino, st.st_mtime_ns, st.st_size)
    assert split is not None
    try:
        _check_split_member(path, match, *split)
    except FormatError:
        return path  # it stands for no set but itself: opening it says what is wrong
    return path.with_name(f"{match['prefix']}-00001-of-{match['count']}.gguf")


def _check_split_member(path: Path, match: re.Match[str], no: int, count: int) -> None:
    """A file named as a split of a set must be one: ``split.no`` in ``0..count-1``, and its
    name's number and count those of its split keys."""
    if not 0 <= no < count:
        raise FormatError(f"its split.no ({no}) is out of range for split.count {count} (0 to {count - 1}): it is "
                          "no file of a split set", path)
    if int(match["count"]) != count or int(match["no"]) != no + 1:
        raise FormatError(f"named split {int(match['no'])} of {int(match['count'])}, but its split keys say "
                          f"{no + 1} of {count} (split.no {no}, split.count {count})", path)


def load_gguf_split(path: Path) -> TensorSet:
    """The files of the GGUF split set that ``path`` belongs to, checked: named as llama.cpp
    names them, each present, its ``split.no`` its place and ``split.count`` the same in all."""
    from .gguf.header import parse_gguf

    path = Path(path)
    match = GGUF_SPLIT_NAME.fullmatch(path.name)
    header = parse_gguf(path)
    split = header.split
    assert split is not None
    if match is None:
        raise FormatError(f"a file of a split GGUF set (split {split.no + 1} of {split.count}) not named "
                          "PREFIX-0000N-of-0000M.gguf, as llama.cpp names them: its other files cannot be found",
                          path)
    _check_split_member(path, match, split.no, split.count)
    files = [path.with_name(f"{match['prefix']}-{i:05d}-of-{match['count']}.gguf") for i in range(1, split.count + 1)]
    total, expected = 0, None
    for number, file in enumerate(files):
        if not file.is_file():
            raise TclipError(f"split {number + 1} of {split.count} ({file.name}) is missing", path)
        other = header if file == path else parse_gguf(file)
        found = other.split
        if found is None or (found.no, found.count) != (number, split.count):
            said = "no split keys" if found is None else f"split {found.no + 1} of {found.count}"
            raise FormatError(f"its split keys say {said}, not split {number + 1} of {split.count}", file)
        total += len(other.tensors)
        if number == 0:
            expected = found.tensors_count
    if expected is not None and expected != total:
        raise FormatError(f"split.tensors.count says the set holds {expected} tensors; its files hold {total}",
                          files[0])
    metadata = {"split.count": split.count}
    return TensorSet(str(path), files, None, {"metadata": metadata}, keep_names=True)


@dataclass
class TensorSet:
    """Files that hold one set of tensors; ``allow`` maps each file to the names the index gives it."""

    name: str
    files: list[Path]
    index: Path | None = None
    index_data: dict[str, Any] = field(default_factory=dict)
    allow: dict[Path, frozenset[str]] | None = None
    names: list[str] = field(default_factory=list)  # every tensor of the set (filled when resolved)
    keep_names: bool = False  # its files are found by their names (GGUF splits): outputs keep them

    @property
    def metadata(self) -> dict[str, Any]:
        return dict(self.index_data.get("metadata") or {})


def no_duplicate_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise ValueError(f"key {key!r} appears twice")
        out[key] = value
    return out


def load_index(path: Path) -> TensorSet:
    """Read and check an index: its shards, in natural order, and each one's tensors (or the
    files of the GGUF split set ``path`` is one of)."""
    path = Path(path)
    if not path.name.endswith(INDEX_SUFFIX) and is_gguf_split(path):
        return load_gguf_split(path)
    try:
        if path.stat().st_size > MAX_INDEX_BYTES:
            raise FormatError(f"index larger than {MAX_INDEX_BYTES >> 20} MiB", path)
        data = json.loads(path.read_bytes().decode("utf-8"), object_pairs_hook=no_duplicate_keys)
    except (UnicodeDecodeError, ValueError, RecursionError) as error:
        raise FormatError(f"not a valid index (JSON: {str(error)[:200]})", path) from None
    except OSError as error:
        raise TclipError(f"cannot read ({error.strerror or error})", path) from None
    if not isinstance(data, dict) or not isinstance(data.get("weight_map"), dict):
        raise FormatError("not a valid index: no \"weight_map\" object mapping tensors to shard files", path)
    if "metadata" in data and not isinstance(data["metadata"], dict):
        raise FormatError("not a valid index: \"metadata\" is not an object", path)
    folder = path.parent
    # Keyed by the path, not the text: "a.safetensors" and "./a.safetensors" are one shard.
    files: dict[Path, Path] = {}
    names: dict[Path, set[str]] = {}
    for tensor, shard in data["weight_map"].items():
        if not isinstance(shard, str) or not shard:
            raise FormatError(f"index maps tensor {tensor!r} to {shard!r}, not a file name", path)
        parts = shard.replace("\\", "/").split("/")
        if shard.startswith(("/", "\\")) or ".." in parts or ":" in parts[0] or "\0" in shard:
            raise FormatError(f"index maps tensor {tensor!r} to {shard!r}, outside the index's folder", path)
        file = files.setdefault(folder / shard, folder / shard)
        names.setdefault(file, set()).add(tensor)
    if not files:
        raise FormatError("index lists no tensors", path)
    # Shards in natural order (00001, 00002, ...), not in the order of the weight map's
    # names, which scrambles them: reports, JSON and passes list them as people number them.
    shards = sorted(files.values(), key=lambda f: natural_key(f.relative_to(folder).as_posix()))
    return TensorSet(str(path), shards, path, data, {f: frozenset(n) for f, n in names.items()})


def check_members(tensor_set: TensorSet, headers: dict[Path, list[str]]) -> None:
    """Every tensor the index gives a shard is there, and no tensor is in two files."""
    where: dict[str, Path] = {}
    for file in tensor_set.files:
        present = set(headers[file])
        if tensor_set.allow is not None:
            missing = sorted(tensor_set.allow[file] - present)
            if missing:
                raise FormatError(f"the index maps tensor {missing[0]!r} to {file.name}, which does not hold it"
                                  + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""),
                                  tensor_set.index)
        for name in headers[file]:
            if name in where:
                raise FormatError(f"tensor {name!r} is in two files: {where[name]} and {file}",
                                  tensor_set.index or file)
            where[name] = file


def check_distinct(tensor_set: TensorSet) -> None:
    """No file of a set is another of its files under a second name (a symlink or a hard
    link): its tensors would be "in two files", and a rewrite would write it twice."""
    seen: dict[tuple[int, int], Path] = {}
    for file in tensor_set.files:
        try:
            st = file.stat()
        except OSError:
            continue  # reported when it is read
        first = seen.get((st.st_dev, st.st_ino))
        if first is not None:
            what = "the index names one file twice" if tensor_set.index is not None else "the same file is given twice"
            names = f"{first}" if str(first) == str(file) else f"{first} and {file} are one file"
            raise TclipError(f"{what} ({names}); name each file once", tensor_set.index or file)
        seen[(st.st_dev, st.st_ino)] = file


def read_headers(files: list[Path]) -> dict[Path, list[str]]:
    out = {}
    for file in files:
        with open_reader(file) as reader:
            out[file] = list(reader.tensors)
    return out


def resolve(tensor_set: TensorSet) -> TensorSet:
    if tensor_set.index is not None and not tensor_set.files:
        loaded = load_index(tensor_set.index)
        loaded.name = tensor_set.name
        tensor_set = loaded
    for file in tensor_set.files:
        if not file.is_file() and not is_hf_shards_folder(file):  # (DCP's per-rank pieces: a folder is one file)
            raise TclipError(f"shard {file.name} is missing" if tensor_set.index else "no such file", file)
    check_distinct(tensor_set)
    headers = read_headers(tensor_set.files)
    check_members(tensor_set, headers)
    tensor_set.names = [n for f in tensor_set.files for n in headers[f]
                        if tensor_set.allow is None or n in tensor_set.allow[f]]
    return tensor_set


def write_index(tensor_set: TensorSet, target: Path, shards: list[Path | None],
                overwrite: bool) -> tuple[int, int, int] | None:
    """The index, last: same weight_map, total_size recomputed from the written shards'
    headers (all of them: a resumed run rewrites only some), tied tensors counted once.
    Returns the identity of the file written (:func:`~tclip.formats.atomic.file_identity`)."""
    data = json.loads(json.dumps(tensor_set.index_data))
    metadata = dict(data.get("metadata") or {})
    metadata.pop(IN_PROGRESS_KEY, None)
    total = 0
    for shard in shards:
        assert shard is not None
        with open_reader(shard) as reader:
            # a tensor tied to another (one storage, as torch.save keeps it) is stored once
            tied = {second for _, second, same in reader.overlaps() if same}
            total += sum(t.nbytes for name, t in reader.tensors.items() if name not in tied)
    metadata["total_size"] = total
    data["metadata"] = metadata
    return write_json(target, data, tensor_set.index, overwrite=overwrite)


class SetReader(TensorReader):
    """The tensors of every file of a set as one reader (for ``diff`` of sharded checkpoints).

    Each shard keeps its own reader; reads go to the shard that holds the tensor.
    """

    format_name = "set"

    def __init__(self, tensor_set: TensorSet) -> None:
        super().__init__(Path(tensor_set.name))
        self.readers: list[TensorReader] = []
        self.owner: dict[str, TensorReader] = {}
        try:
            for file in tensor_set.files:
                reader = open_reader(file)
                self.readers.append(reader)
                allowed = tensor_set.allow[file] if tensor_set.allow is not None else None
                for name, info in reader.tensors.items():
                    if allowed is None or name in allowed:
                        self.tensors[name] = info
                        self.owner[name] = reader
                self.others += reader.others
        except BaseException:
            self.close()
            raise
        self.metadata = tensor_set.metadata
        self.format_name = self.readers[0].format_name if self.readers else "set"

    def close(self) -> None:
        for reader in self.readers:
            reader.close()
        self.readers = []

    def read(self, name: str, index: Any = None, scratch: Any = None) -> Any:
        return self.owner[name].read(name, index, scratch)

    def read_flat(self, name: str, start: int, stop: int, out: Any = None) -> Any:
        return self.owner[name].read_flat(name, start, stop, out)

    def read_part(self, name: str, start: int, stop: int, out: Any = None) -> Any:
        return self.owner[name].read_part(name, start, stop, out)

    def part_parallel_safe(self, name: str) -> bool:
        return self.owner[name].part_parallel_safe(name)

    def region(self, name: str) -> tuple[int, int] | None:
        return self.owner[name].region(name)

    def parallel_safe(self, name: str) -> bool:
        return self.owner[name].parallel_safe(name)

    def align(self, name: str) -> int:
        return self.owner[name].align(name)


def open_any(path: Path) -> TensorReader:
    """A reader for a file, or for the set an index names."""
    if is_index(path):
        return SetReader(resolve(TensorSet(str(path), [], path)))
    return open_reader(path)
