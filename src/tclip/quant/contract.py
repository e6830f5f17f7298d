"""The typed contract of a quantized weight's encoding: its values, its statistics, its rescale.

A format lists a quantized weight as one :class:`~tclip.formats.base.TensorInfo` whose
``encoding`` says what is stored (:class:`~tclip.formats.base.Encoding`: a summary and the
stored bytes). :mod:`tclip.quant` gives it one that computes, a :class:`QuantEncoding`
(every method gets the reader that listed ``info``; it reads the stored parts with
:meth:`~tclip.formats.base.TensorReader.read_part`, whichever file of a set holds them):

- :attr:`~QuantEncoding.summary`: an :class:`~tclip.formats.base.EncodingSummary`.
- :meth:`~QuantEncoding.source`: the logical values, float64, in C order of the logical shape
  (a :class:`ValueSource`). Used where values are needed as values: ``diff``.
- :meth:`~QuantEncoding.reducer`: the statistics of units in closed form (a :class:`Reducer`).
  With ``factor`` it gives the statistics of the tensor as :meth:`~QuantEncoding.rescale` by
  that factor would leave it (pass 2's after-statistics, nothing written).
- :meth:`~QuantEncoding.rescale`: jobs that write the parts a rescale by ``factor`` rewrites --
  those this writer's file holds -- through ``writer.write_flat``; every other part is copied
  by the pass as it is. ``factor`` is a 0-d float64 array, or one factor per row in keepdims
  form (``[..., rows, 1]``, only where ``summary.per_row``). Raises ValueError when it cannot
  be done exactly as ``summary.factors`` promises.

The two kinds of stored layout:

(a) codes plus scale tensors (:class:`~tclip.quant.encoding.BlockScaled`): a view
    (:class:`~tclip.quant.view.LogicalReader`) lists the weight in place of its parts, which
    it reads from whichever file holds them; the writer writes the stored tensors, the jobs
    only the scale parts.
(b) one stored tensor of blocks (GGUF: :class:`~tclip.quant.ggml.encoding.GgmlBlocks`; the
    test suite's toy Q8_0): the reader lists the encoded tensor under its stored name, with
    ``nbytes`` the blob's size and ``read_part`` its raw bytes; a job writes the blocks with
    their scales rewritten (an untouched blob is copied).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol, runtime_checkable

import numpy as np

from ..core.stats import TensorStats, UnitResult
from ..core.units import UnitGrid
from ..errors import TclipError
from ..formats.base import Encoding, EncodingSummary, TensorInfo, TensorReader, TensorWriter
from .codes import Findings

__all__ = ["LandingCheck", "QuantEncoding", "Reducer", "Rescale", "UnitResult", "ValueSource", "computing"]

# (stored part, job) for each part of a file a rescale rewrites; a job returns the bytes it wrote.
Rescale = list[tuple[str, Callable[[], int]]]


class ValueSource(Protocol):
    """Elements ``[start, stop)`` of a tensor in C order (what a pass reads, block by block).

    ``dtype``: the values' dtype (its ``itemsize`` is what an element costs the block budget);
    ``parallel_safe``: reads may run in threads at once; ``align``: a run's start is a multiple
    of it (0: any)."""

    dtype: np.dtype
    parallel_safe: bool
    align: int

    def read(self, start: int, stop: int, out: np.ndarray | None) -> Any:
        """The data for elements ``[start, stop)`` (into ``out`` where the source can)."""


class Reducer(ValueSource, Protocol):
    """The statistics of units in closed form.

    :meth:`read` returns whatever raw data it wants for elements ``[start, stop)`` (a run of
    whole units of ``UnitGrid.of(info.shape, unit_elements)``, ``unit_elements`` the reducer's
    attribute if it has one; the data has ``nbytes``, the bytes read, for progress).
    :meth:`reduce` gives, for each unit ``first..stop-1``, the :class:`UnitResult`
    :meth:`TensorStats.reduce` would give for its values, and the :class:`Findings` (or None)
    of what the stored parts held (NaN codes, NaN/Inf/zero scales, with positions). Results
    depend on the units alone (never on blocks or threads); findings merge in any order.
    """

    def reduce(self, data: Any, grid: UnitGrid, first: int, stop: int, stats: TensorStats,
               scratch: Any) -> tuple[list[UnitResult], Findings | None]:
        """One :class:`UnitResult` per unit ``first..stop-1``, and what the stored parts held."""


@runtime_checkable
class LandingCheck(Protocol):
    """A reducer with a factor that also checks the rescale it measured (pass 2's
    after-statistics of codes plus scales), before anything is committed."""

    def check_landing(self, tolerance: float, path: object) -> None:
        """Refuse (UnsupportedError) a rescale whose rounded scales leave the weight -- or a
        row, with one factor per row -- further than ``tolerance`` from the factor times it."""

    def flushed(self) -> int:
        """Non-zero values the rescale made zero."""


@runtime_checkable
class QuantEncoding(Encoding, Protocol):
    """An encoding that computes: values, statistics and rescales (see the module doc)."""

    @property
    def summary(self) -> EncodingSummary:
        """What the encoding is."""

    def source(self, reader: TensorReader, info: TensorInfo) -> ValueSource:
        """The logical values (float64, C order)."""

    def reducer(self, reader: TensorReader, info: TensorInfo, factor: np.ndarray | None = None) -> Reducer:
        """Closed-form statistics per unit (after a rescale by ``factor`` when given)."""

    def rescale(self, reader: TensorReader, writer: TensorWriter, info: TensorInfo,
                factor: np.ndarray) -> Rescale:
        """(stored part, job) for each part of this file a rescale rewrites."""


def computing(reader: TensorReader, info: TensorInfo) -> QuantEncoding:
    """``info``'s encoding, one that computes: a tensor listed as stored blocks is only ever
    walked through :mod:`tclip.quant.view`, which decodes it (never read as plain values)."""
    encoding = info.encoding
    if not isinstance(encoding, QuantEncoding):
        raise TclipError(f"internal error: tensor {info.name!r} is listed as stored {info.dtype_label} data that "
                         "nothing decoded (it is read through tclip.quant.view)", reader.path)
    return encoding
