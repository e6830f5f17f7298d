"""The Python API for scripts: ``tclip.open``, ``report``, ``summary``, ``clip``, ``diff``.

A layer above :mod:`tclip.work`, beside the command line: a PATH is whatever the command
line takes (a file, a folder, a glob, an index, a GGUF split set, a DCP folder), found by
the same functions (:func:`tclip.work.inputs.expand_files`, :func:`tclip.work.sets.group_sets`),
and each call is one of the work layer's public functions, its result turned into the
plain records of :mod:`tclip.api_records`. See docs/python.md.
"""

from __future__ import annotations

import os
from pathlib import Path
from types import TracebackType
from typing import Any, Iterable, Iterator, Sequence, Union

import numpy as np

from .api_records import ClipResult, DiffResult, HistorySummary, Report, Summary, TensorInfo
from .core.modes import AverageNormClip, GlobalNormClip, Mode, NormClip, ValueClip
from .core.stats import AxesLike, parse_axes
from .errors import TclipError
from .formats.base import TensorReader
from .quant.view import logical_view, stored_reader
from .formats.sharded import SetReader, TensorSet, is_index, resolve
from .work.budget import Budget
from .work.inputs import diff_input, expand_files
from .work.selection import Selection

PathLike = Union[str, "os.PathLike[str]"]

__all__ = ["Checkpoint", "open", "report", "summary", "clip", "diff", "TclipError"]


def _inputs(path: PathLike | Sequence[PathLike], across_files: bool, recursive: bool,
            use_sets: bool | None = None) -> list[tuple[str, TensorSet | Path]]:
    """What ``path`` stands for, as the command line reads it: files, or sets where an index
    (or ``across_files``) makes one. A name that matches nothing is an error naming it."""
    from .work.sets import group_sets

    items = (os.fspath(path),) if isinstance(path, (str, os.PathLike)) else tuple(os.fspath(p) for p in path)
    found = list(expand_files(items, recursive, []))
    for name, item in found:
        if item is None:
            raise TclipError("no tensor files match", name)
    if use_sets is None:
        use_sets = across_files or any(is_index(p) for _, p in found)
    if not use_sets:
        return [(name, item) for name, item in found if item is not None]
    return [(name, item) for name, item in group_sets(found, across_files) if item is not None]


def _one(path: PathLike, across_files: bool, recursive: bool = False) -> tuple[str, TensorSet | Path]:
    found = _inputs(path, across_files, recursive)
    if len(found) != 1:
        raise TclipError(f"stands for {len(found)} files or sets; name one, pass across_files=True to take them "
                         "as one set, or use tclip.summary", os.fspath(path))
    return found[0]


def _selection(include: Sequence[str], exclude: Sequence[str]) -> Selection:
    return Selection(tuple(include), tuple(exclude))


# --------------------------------------------------------------------------- open


class Checkpoint:
    """A checkpoint opened read-only: a mapping of tensor names to NumPy arrays, read lazily.

    ``ck[name]`` reads that tensor alone: plain tensors bit-identical in their own dtype
    (bfloat16 and float8 as ``ml_dtypes`` types), quantized weights (GGUF blocks, FP8/NVFP4
    codes with their scale tensors) dequantized to float32, as ``report`` counts them.
    The stored tensors stay reachable: ``ck.stored_names`` and ``ck.stored(name)``.
    """

    def __init__(self, reader: TensorReader, path: str) -> None:
        self._reader, self.path = reader, path

    @property
    def format(self) -> str:
        return self._reader.format_name

    @property
    def names(self) -> list[str]:
        """The tensor names (quantized weights by their weight's name), in natural order."""
        from .text import natural_key

        return sorted(self._reader.tensors, key=natural_key)

    @property
    def metadata(self) -> dict[str, Any]:
        return dict(self._reader.metadata)

    def __iter__(self) -> Iterator[str]:
        return iter(self.names)

    def __len__(self) -> int:
        return len(self._reader.tensors)

    def __contains__(self, name: object) -> bool:
        return name in self._reader.tensors

    def _info(self, name: str) -> Any:
        try:
            return self._reader.tensors[name]
        except KeyError:
            raise KeyError(name) from None

    def info(self, name: str) -> TensorInfo:
        """Shape, dtype and stored size of one tensor, from the header (``KeyError`` if unknown)."""
        info = self._info(name)
        quantized = info.encoding is not None
        dtype = "float32" if quantized else str(info.dtype)
        label = info.dtype_label if info.dtype_label is not None else None
        return TensorInfo(name, tuple(int(n) for n in info.shape), dtype, int(info.nbytes), quantized, label)

    def __getitem__(self, name: str) -> np.ndarray:
        info = self._info(name)
        if info.refused is not None:
            raise TclipError(f"{name!r}: {info.refused}", self.path)
        if not info.numeric or info.unreadable_type:
            raise TclipError(f"{name!r} holds data tclip does not read as numbers ({info.dtype_label or info.dtype})",
                             self.path)
        if info.encoding is None:
            return np.asarray(self._reader.read(name))
        values = info.encoding.source(self._reader, info).read(0, info.size, None)
        return np.asarray(values, np.float64).astype(np.float32).reshape(info.shape)

    @property
    def stored_names(self) -> list[str]:
        """The tensors as the file stores them (a quantized weight's codes, scales and blocks)."""
        from .text import natural_key

        return sorted(stored_reader(self._reader).tensors, key=natural_key)

    def stored(self, name: str) -> np.ndarray:
        """A stored tensor as the file holds it: FP8 codes and scale tensors as their dtypes,
        a GGUF quantized tensor as its raw bytes (uint8)."""
        reader = stored_reader(self._reader)
        if name not in reader.tensors:
            raise KeyError(name)
        info = reader.tensors[name]
        if info.encoding is not None:
            return np.asarray(reader.read_part(name, 0, info.nbytes), np.uint8)
        return np.asarray(reader.read(name))

    def close(self) -> None:
        self._reader.close()

    def __enter__(self) -> "Checkpoint":
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 trace: TracebackType | None) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<tclip.Checkpoint {self.path!r}: {len(self)} tensors, {self.format}>"


def _set_reader(tensor_set: TensorSet) -> TensorReader:
    from .work.sets import set_layout

    tensor_set = resolve(tensor_set)
    reader = SetReader(tensor_set)
    try:
        layout = set_layout(tensor_set)
        return logical_view(reader, layout if layout else None)
    except BaseException:
        reader.close()
        raise


def open(path: PathLike, *, across_files: bool = False, recursive: bool = False) -> Checkpoint:  # noqa: A001
    """Open a checkpoint read-only: a file, a folder, a glob, an index, a GGUF split set or a
    DCP folder (with ``across_files``, several loose files as one set). Nothing is read but
    headers until a tensor is asked for."""
    from .quant.view import open_logical

    name, item = _one(path, across_files, recursive)
    if isinstance(item, TensorSet):
        return Checkpoint(_set_reader(item), name)
    if is_index(item):
        return Checkpoint(_set_reader(TensorSet(name, [], item)), name)
    return Checkpoint(open_logical(item), name)


# --------------------------------------------------------------------------- report, summary


def _report(name: str, item: TensorSet | Path, *, max_norm: float | None, axes: AxesLike,
            ord: str, selection: Selection, stats: bool, memory: int, threads: int) -> Report:
    from .work.clip import report_file
    from .work.gate import apply_gate
    from .work.sets import report_set

    axes_tuple = parse_axes(axes)  # (checked once, here: a set's tensors may never reach the rank check)
    if isinstance(item, TensorSet):
        raw = report_set(item, selection, ord, axes_tuple, stats, Budget(memory, threads), max_norm=max_norm)
        where: object = item.name
    else:
        raw = report_file(item, axes=axes_tuple, ord=ord, selection=selection, moments=stats, memory=memory,
                          threads=threads, max_norm=max_norm)
        where = item
    if max_norm is not None:
        apply_gate(raw, max_norm, axes_tuple is not None, where, selection)
    return Report.of(raw)


def report(path: PathLike, *, max_norm: float | None = None, axes: AxesLike = None,
           ord: str = "2", include: Sequence[str] = (), exclude: Sequence[str] = (), stats: bool = False,
           across_files: bool = False, recursive: bool = False, memory: int = Budget.memory,
           threads: int = 0) -> Report:
    """``tclip report`` on one file or set: norms, NaN/Inf, and with ``max_norm`` the gate's
    verdict (``passed``). The options are the command's flags."""
    name, item = _one(path, across_files, recursive)
    return _report(name, item, max_norm=max_norm, axes=axes, ord=ord, selection=_selection(include, exclude),
                   stats=stats, memory=memory, threads=threads)


def summary(paths: PathLike | Iterable[PathLike], *, of: str = "norms", ord: str = "2",
            include: Sequence[str] = (), exclude: Sequence[str] = (), recursive: bool = False,
            memory: int = Budget.memory, threads: int = 0, sort: str = "name") -> Summary | HistorySummary:
    """``tclip report --summary --of norms|grads|drift``: one report per file or set (files,
    folders, globs), in step order (``of="norms"``, a :class:`Summary`), or the run's gradient
    norms from Adam state (``"grads"``) or its weights' drift between checkpoints (``"drift"``),
    a :class:`HistorySummary`. ``sort`` ("name" or "order") orders grads and drift's files."""
    from .work.summary import in_step_order

    if of not in ("norms", "grads", "drift"):
        raise ValueError(f"of={of!r}: tclip.summary gives 'norms', 'grads' or 'drift'")
    items = paths if isinstance(paths, (str, os.PathLike)) else list(paths)
    if of != "norms":
        return _history(items, of, _selection(include, exclude), recursive, memory, threads, sort)
    selection = _selection(include, exclude)
    reports = [_report(name, item, max_norm=None, axes=None, ord=ord, selection=selection, stats=False,
                       memory=memory, threads=threads) for name, item in _inputs(items, False, recursive)]
    by_file = {r.raw.file: r for r in reports}
    return Summary(of, [by_file[r.file] for r in in_step_order([r.raw for r in reports])])


def _history(items: PathLike | list[PathLike], of: str, selection: Selection, recursive: bool, memory: int,
             threads: int, sort: str) -> HistorySummary:
    """``--of grads|drift``: the work layer's grid over the files, as the command line builds it."""
    from .work.history import drift_grid, grads_grid, grid_json
    from .work.summary import file_labels

    if sort not in ("name", "order"):
        raise ValueError(f"sort={sort!r}: 'name' or 'order'")
    paths = [item for _, item in _inputs(items, False, recursive, use_sets=False) if isinstance(item, Path)]
    grid = grads_grid(paths, sort, selection) if of == "grads" else drift_grid(paths, sort, selection, memory,
                                                                                threads)
    labels = file_labels(grid.columns)
    return HistorySummary(of, grid_json(grid, labels), grid)


# --------------------------------------------------------------------------- clip, diff


def clip(path: PathLike, mode: Mode, *, output: PathLike | None = None, out_dir: PathLike | None = None,
         dry_run: bool = False, in_place: bool = False, overwrite: bool = False, include: Sequence[str] = (),
         exclude: Sequence[str] = (), nonfinite: str = "error", strict: bool = False, drop_nonnumeric: bool = False,
         across_files: bool = False, recursive: bool = False, memory: int = Budget.memory,
         threads: int = 0) -> ClipResult:
    """``tclip clip``: clip one file or set with ``mode`` (:class:`NormClip`, :class:`GlobalNormClip`,
    :class:`ValueClip`, :class:`AverageNormClip`) and write the result (``output``, else
    ``NAME.clipped.EXT`` beside it or in ``out_dir``). The options are the command's flags, but
    ``overwrite`` is ``--force`` (the name the library's messages use)."""
    from .work.clip import clip_file, clip_set
    from .work.options import ClipOptions

    if not isinstance(mode, (NormClip, AverageNormClip, GlobalNormClip, ValueClip)):
        raise TypeError("mode must be NormClip, GlobalNormClip, ValueClip or AverageNormClip")
    options = ClipOptions(output=None if output is None else Path(output),
                          out_dir=None if out_dir is None else Path(out_dir), in_place=in_place, overwrite=overwrite,
                          selection=_selection(include, exclude), nonfinite=nonfinite, strict=strict,
                          dry_run=dry_run, memory=memory, threads=threads,
                          drop_nonnumeric=drop_nonnumeric)
    _, item = _one(path, across_files, recursive)
    raw = clip_set(item, mode, options) if isinstance(item, TensorSet) else clip_file(item, mode, options)
    return ClipResult.of(raw)


def diff(a: PathLike, b: PathLike, *, rtol: float = 0.0, atol: float = 0.0, map: Sequence[str] = (),  # noqa: A002
         include: Sequence[str] = (), exclude: Sequence[str] = (), tensors_only: bool = False,
         memory: int = Budget.memory, threads: int = 0) -> DiffResult:
    """``tclip diff``: compare two files, sets or folders tensor by tensor; ``verdict`` is
    "same" only where everything was compared and equal. ``map``: ``OLD=NEW`` rename rules."""
    from .work.diff import diff_files
    from .work.mapping import parse_mapping

    rules = parse_mapping(tuple(map))
    raw = diff_files(diff_input(os.fspath(a)), diff_input(os.fspath(b)), rtol=rtol, atol=atol, mapping=rules,
                     selection=_selection(include, exclude), memory=memory, threads=threads,
                     tensors_only=tensors_only)
    return DiffResult.of(raw)
