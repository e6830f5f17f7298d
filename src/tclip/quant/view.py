"""Files and sets seen as their logical tensors: the quantized weights decoded, their parts hidden.

:class:`LogicalReader` shows a file -- or a whole set -- as its logical tensors: each weight
stored as codes plus scale tensors once, under its name, in the file whose passes own it; its
parts hidden; activation scales marked as no weights. A GGUF tensor of ggml blocks, which its
reader lists tagged with its ggml type, is given the encoding that computes it
(:func:`tclip.quant.ggml.encoding.decode`). :func:`open_logical` opens a file that way, reading
the quantization config beside it; :func:`logical_view` does it for a reader already open.
Every pass over files reads through this view: the formats below list, this package computes.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np

from ..core.dtypes import is_floating
from ..errors import TclipError, UnsupportedError
from ..formats._io import DEFAULT_BLOCK_BYTES
from ..formats.base import Encoding, TensorInfo, TensorReader
from ..formats.gguf.files import GgmlStored
from .encoding import BlockScaled, Undecoded
from .layout import QuantLayout, QuantWeight, detect, headers_of, read_configs


def logical_dtype(weight: QuantWeight, dtypes: dict[str, np.dtype]) -> np.dtype:
    """The dtype a rescale rounds in (the rewritten scale's), float32 where that is no float."""
    rescaled = weight.rescaled
    if rescaled is not None:
        dtype = dtypes.get(rescaled.name)
        if dtype is not None and is_floating(dtype) and weight.scheme is not None and not (
                rescaled.role == "scales" and weight.scheme.e8m0):
            return np.dtype(dtype)
    return np.dtype(np.float32)


class LogicalReader(TensorReader):
    """A file, or a set's reader, seen as its logical tensors (see the module's docstring).

    ``here``: the file this view is of within a set (its own weights are those whose
    ``owner`` it is; parts in other files are read from them, opened here); None: every
    weight of ``layout`` is this view's (a single file, or a reader over a whole set).
    """

    def __init__(self, stored: TensorReader, layout: QuantLayout, here: str | None = None,
                 opener: Callable[[Path], TensorReader] | None = None) -> None:
        super().__init__(stored.path)
        self.stored, self.layout, self.here = stored, layout, here
        self.format_name = stored.format_name
        self.metadata = stored.metadata
        self.others = stored.others
        self.damage = stored.damage
        self._extra: dict[str, TensorReader] = {}
        if opener is None:
            from ..formats.registry import open_reader

            opener = open_reader
        try:
            if here is not None:
                for file in sorted(layout.files_needed(here)):
                    self._extra[file] = opener(Path(file))
            self._build()
        except BaseException:
            self._close_extra()
            raise

    def _dtypes(self) -> dict[str, np.dtype]:
        out = {n: i.dtype for n, i in self.stored.tensors.items()}
        for reader in self._extra.values():
            out.update({n: i.dtype for n, i in reader.tensors.items()})
        return out

    def _build(self) -> None:
        layout = self.layout
        dtypes = self._dtypes()
        nbytes = {n: i.nbytes for n, i in self.stored.tensors.items()}
        for reader in self._extra.values():
            nbytes.update({n: i.nbytes for n, i in reader.tensors.items()})
        for name, info in self.stored.tensors.items():
            if name in layout.activation:
                self.tensors[name] = replace(info, role="activation scale (not a weight)")
                continue
            logical = layout.part_of.get(name)
            if logical is None:
                self.tensors[name] = info
                continue
            weight = layout.weights[logical]
            if logical in self.tensors or (self.here is not None and weight.owner != self.here):
                continue
            size = sum(nbytes.get(p.name, 0) for p in weight.parts)
            if weight.scheme is None:
                encoding: Encoding = Undecoded(weight, size)
                label = "quantized"
            else:
                encoding = BlockScaled(weight, logical_dtype(weight, dtypes), size)
                label = weight.scheme.label
            dtype = encoding.dtype if isinstance(encoding, BlockScaled) else np.dtype(np.float32)
            self.tensors[logical] = TensorInfo(logical, weight.shape, dtype, dtype_label=label, encoding=encoding)

    def overlaps(self) -> list[tuple[str, str, bool]]:
        """The stored reader's shared bytes, a part named by the weight it is part of.

        A part sharing bytes with another tensor is reported as its logical weight
        (never as identical views: the two are different kinds of values), so a plan
        changing one of them is refused by ``work/tied.py`` as for any other tensors.
        Two parts of one weight sharing bytes are refused here.
        """
        out = []
        for first, second, same in self.stored.overlaps():
            a, b = (self.layout.part_of.get(n, n) for n in (first, second))
            if a == b:  # codes and scales of one weight in the same bytes: no real file does this
                raise UnsupportedError(f"{first!r} and {second!r}, parts of the quantized weight {a!r}, share "
                                       "bytes in the file", self.path)
            out.append((a, b, same and (a, b) == (first, second)))
        return out

    def _holder(self, name: str) -> TensorReader:
        if name in self.stored.tensors:
            return self.stored
        logical = self.layout.part_of.get(name)
        if logical is not None:
            for part in self.layout.weights[logical].parts:
                if part.name == name and part.file in self._extra:
                    return self._extra[part.file]
        raise TclipError(f"internal error: no file of this view holds {name!r}", self.path)

    def read_part(self, name: str, start: int, stop: int, out: np.ndarray | None = None) -> np.ndarray:
        return self._holder(name).read_part(name, start, stop, out)

    def part_parallel_safe(self, name: str) -> bool:
        return self._holder(name).part_parallel_safe(name)

    def read(self, name: str, index: Any = None, scratch: Any = None) -> np.ndarray:
        return self.stored.read(name, index, scratch)

    def read_flat(self, name: str, start: int, stop: int, out: np.ndarray | None = None) -> np.ndarray:
        return self.stored.read_flat(name, start, stop, out)

    def region(self, name: str) -> tuple[int, int] | None:
        return None if name not in self.stored.tensors else self.stored.region(name)

    def parallel_safe(self, name: str) -> bool:
        return name in self.stored.tensors and self.stored.parallel_safe(name)

    def align(self, name: str) -> int:
        return self.stored.align(name) if name in self.stored.tensors else 0

    def blocks(self, name: str, max_bytes: int = DEFAULT_BLOCK_BYTES) -> Any:
        return self.stored.blocks(name, max_bytes)

    def lost_in_conversion(self) -> list[str]:
        return self.stored.lost_in_conversion()

    def other_values(self, name: str, limit: int) -> np.ndarray | None:
        return self.stored.other_values(name, limit)

    def other_stored_bytes(self, name: str, chunk: int = 1 << 20) -> Iterator[bytes] | None:
        return self.stored.other_stored_bytes(name, chunk)

    def stored_bytes(self, name: str, chunk: int = 1 << 20) -> Any:
        return self.stored.stored_bytes(name, chunk)

    def _close_extra(self) -> None:
        for reader in self._extra.values():
            reader.close()
        self._extra = {}

    def close(self) -> None:
        try:
            self._close_extra()
        finally:
            self.stored.close()


def stored_reader(reader: TensorReader) -> TensorReader:
    """The reader of what the file stores (a :class:`LogicalReader`'s underlying one)."""
    return reader.stored if isinstance(reader, LogicalReader) else reader


def decode_blocks(reader: TensorReader) -> None:
    """Give every tensor ``reader`` lists as stored ggml blocks the encoding that computes it.

    In place (the reader's own :class:`TensorInfo`, which a reader over a set shares with
    the reader of its file), once: a decoded tensor is left as it is. The blocks' arithmetic
    is imported on first use: a run that meets no GGUF file need not pay for it."""
    for info in reader.tensors.values():
        if isinstance(info.encoding, GgmlStored):
            from .ggml.encoding import decode

            info.encoding = decode(info.encoding)


def layout_of_file(path: Path, reader: TensorReader) -> QuantLayout:
    """The quantized weights of one file, with the config beside it."""
    return detect({os.fspath(path): list(reader.tensors.values())}, read_configs(Path(path).parent))


def layout_of_files(files: list[Path], folder: Path, opener: Callable[[Path], TensorReader]) -> QuantLayout:
    """The quantized weights of a set of files (the config from ``folder``)."""
    return detect(headers_of(files, opener), read_configs(folder))


def logical_view(reader: TensorReader, layout: QuantLayout | None = None, here: str | None = None
                 ) -> TensorReader:
    """``reader`` seen as its logical tensors when it holds quantized weights, else itself
    (its GGUF block tensors decoded: :func:`decode_blocks`).

    ``layout`` None: detected from the file itself and the config beside it."""
    if isinstance(reader, LogicalReader):
        return reader
    decode_blocks(reader)
    if layout is None:
        layout = layout_of_file(reader.path, reader)
    if not layout:
        return reader
    return LogicalReader(reader, layout, here)


def open_logical(path: Path | str, layout: QuantLayout | None = None, here: str | None = None) -> TensorReader:
    """Open a file as its logical tensors (see :func:`logical_view`)."""
    from ..formats.registry import open_reader

    reader = open_reader(path)
    try:
        return logical_view(reader, layout, here)
    except BaseException:
        reader.close()
        raise


def open_any_logical(path: Path) -> TensorReader:
    """A file, or the set an index names (one reader over every shard), as its logical tensors."""
    from ..formats.sharded import SetReader, TensorSet, is_index, resolve

    if not is_index(path):
        return open_logical(path)
    tensor_set = resolve(TensorSet(str(path), [], Path(path)))
    reader = SetReader(tensor_set)
    try:
        layout = detect({os.fspath(path): list(reader.tensors.values())}, read_configs(Path(path).parent))
        return logical_view(reader, layout)
    except BaseException:
        reader.close()
        raise
