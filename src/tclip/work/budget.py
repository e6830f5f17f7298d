"""Runs the blocks of one pass over a file on a pool of threads, within a memory budget.

A pass is a stream of jobs in file order: the blocks of each tensor (runs of
whole units, :mod:`tclip.core.units`) and, between them, copies of untouched
tensors. Workers read a block (when the reader allows reads from any thread),
compute on it (NumPy releases the GIL) and, when the writer allows writes from
any thread, write it. The main thread then takes the results *in job order*:
it merges per-slice sums in unit order, hands blocks to writers that need
order, runs the copies and reports progress. So results are bit-identical for
any thread count and block size, and at most ``inflight`` blocks exist at once.

Memory: ``inflight`` block buffers plus one float64 unit buffer per thread;
:class:`Budget` sizes both from ``--memory``.
"""

from __future__ import annotations

import os
import threading
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np

from .. import interrupt
from ..core.kernels import Scratch
from ..core.units import UNIT_ELEMENTS, UnitGrid

MiB = 1 << 20
DEFAULT_MEMORY = 256 * MiB
MIN_MEMORY = 16 * MiB
MAX_BLOCK_BYTES = 8 * MiB
# An eighth of --memory is set aside for per-slice statistics, scale arrays and bookkeeping.
RESERVE_FRACTION = 8
# More threads than this only add stacks and contention: no machine tclip runs on has more
# cores to use, and the command line refuses more (the library clamps to it).
MAX_THREADS = 1024


def default_threads() -> int:
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)


@dataclass(frozen=True)
class Budget:
    """How much memory and how many threads one pass over a file may use.

    Attributes:
        memory: bytes for block buffers, unit buffers and per-slice arrays.
        threads: worker threads (1: everything on the calling thread).
        block_bytes: the largest block; None sizes it from ``memory``.
    """

    memory: int = DEFAULT_MEMORY
    threads: int = 0  # 0: the machine's cores
    block_bytes: int | None = None

    @property
    def workers(self) -> int:
        return min(MAX_THREADS, self.threads if self.threads > 0 else default_threads())

    def parallel_passes(self, files: int) -> int:
        """How many files' passes may run at once within this one budget: no more than
        the threads, and each with at least :data:`MIN_MEMORY` of the run's memory."""
        return max(1, min(files, self.workers, self.memory // MIN_MEMORY))

    def share(self, parts: int) -> "Budget":
        """The budget of one of ``parts`` passes running at once (files in parallel):
        the parts together take no more memory and threads than this budget
        (``parts`` from :meth:`parallel_passes`)."""
        parts = max(1, parts)
        return Budget(max(MIN_MEMORY, self.memory // parts), max(1, self.workers // parts), self.block_bytes)

    @property
    def slice_bytes(self) -> int:
        """What per-slice statistics and scales of one file may take."""
        return self.memory // RESERVE_FRACTION

    def layout(self, itemsize: int) -> tuple[int, int, int]:
        """(threads, blocks in flight, block bytes) for tensors of ``itemsize``-byte elements."""
        threads = self.workers
        scratch = UNIT_ELEMENTS * Scratch.BYTES_PER_ELEMENT
        unit_bytes = UNIT_ELEMENTS * max(1, itemsize)
        available = self.memory - self.memory // RESERVE_FRACTION
        smallest = min(unit_bytes, MiB)
        # As many threads as fit: each takes its scratch and one block, plus two blocks
        # in flight (solved at once, not one thread at a time: --threads can be huge).
        threads = max(1, min(threads, (available - 2 * smallest) // (scratch + smallest)))
        inflight = threads + 2 if threads > 1 else 1
        block = (available - threads * scratch) // inflight
        block = max(min(unit_bytes, MiB), min(MAX_BLOCK_BYTES, block))
        if self.block_bytes is not None:
            block = max(1, self.block_bytes)
        return threads, inflight, block


@dataclass
class Job:
    """One step of a pass: a block of a tensor, or a whole-tensor action on the main thread."""

    name: str
    first: int = 0   # units [first, stop)
    stop: int = 0
    start: int = 0   # elements [start, end) in storage order
    end: int = 0
    kind: str = "block"  # "block", or "main": ``action`` runs on the main thread in order
    action: Callable[[], Any] | None = None
    data: Any = None  # the block, when the main thread read it
    buffer: np.ndarray | None = None
    step: Any = None  # what the pass driver walks (tclip.work.passes.Walk)


def tensor_jobs(name: str, grid: UnitGrid, itemsize: int, block_bytes: int, align: int = 0) -> Iterator[Job]:
    """The block jobs covering one tensor: runs of whole units of about ``block_bytes``."""
    per_block = max(1, block_bytes // max(1, itemsize))
    for first, stop in grid.blocks(per_block, align):
        start, end = grid.span(first, stop)
        yield Job(name, first, stop, start, end)


class BlockRunner:
    """Executes jobs on worker threads, hands results back in job order."""

    def __init__(self, budget: Budget, itemsize: int = 4) -> None:
        self.threads, self.inflight, self.block_bytes = budget.layout(itemsize)
        self._pool = ThreadPoolExecutor(self.threads, thread_name_prefix="tclip") if self.threads > 1 else None
        self._local = threading.local()
        self._buffers: list[np.ndarray] = []

    def scratch(self) -> Scratch:
        """This thread's unit buffers."""
        buffer = getattr(self._local, "scratch", None)
        if buffer is None:
            buffer = self._local.scratch = Scratch()
        return buffer

    def _buffer(self, nbytes: int) -> np.ndarray:
        for i, buffer in enumerate(self._buffers):
            if buffer.size >= nbytes:
                return self._buffers.pop(i)
        if self._buffers:
            self._buffers.pop(0)
        return np.empty(max(nbytes, 1), np.uint8)

    def _release(self, buffer: np.ndarray | None) -> None:
        if buffer is not None and len(self._buffers) < self.inflight:
            self._buffers.append(buffer)

    def run(self, jobs: Iterable[Job], prepare: Callable[[Job, np.ndarray], Any] | None,
            work: Callable[[Job, np.ndarray], Any], finish: Callable[[Job, Any], None],
            nbytes: Callable[[Job], int]) -> None:
        """For every block job: ``prepare`` (main thread, in order: e.g. a read that
        must be sequential) then ``work`` (any thread) then ``finish`` (main thread,
        in job order). ``main`` jobs run their action at their turn, in order."""
        pending: deque[tuple[Job, Future | Any]] = deque()

        def settle(limit: int) -> None:
            while len(pending) > limit:
                job, future = pending.popleft()
                result = future.result() if isinstance(future, Future) else future
                try:
                    finish(job, result)
                finally:
                    self._release(job.buffer)
                    job.buffer = job.data = None

        try:
            for job in jobs:
                interrupt.check()
                if job.kind == "main":
                    settle(0)
                    assert job.action is not None
                    job.action()
                    continue
                job.buffer = self._buffer(nbytes(job))
                if prepare is not None:
                    job.data = prepare(job, job.buffer)
                if self._pool is None:
                    pending.append((job, work(job, job.buffer)))
                else:
                    pending.append((job, self._pool.submit(work, job, job.buffer)))
                settle(self.inflight - 1)
            settle(0)
        except BaseException:
            for _, future in pending:
                if isinstance(future, Future):
                    future.cancel()
            for _, future in pending:
                if isinstance(future, Future):
                    try:
                        future.result()
                    except BaseException:
                        pass
            raise

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None
        self._buffers.clear()

    def __enter__(self) -> "BlockRunner":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
