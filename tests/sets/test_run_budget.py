"""One budget for a whole run (issue 21.12) and bounded --threads (issue 21.11)."""

from __future__ import annotations

import pytest

from support.cli import run
from support.sets import sharded
from tclip.cli.params import MAX_THREADS as CLI_MAX_THREADS
from tclip.core.kernels import Scratch
from tclip.core.units import UNIT_ELEMENTS
from tclip.work.budget import MAX_THREADS, MIN_MEMORY, RESERVE_FRACTION, Budget, MiB
from tclip.work.sets import TaskPool


@pytest.mark.parametrize("threads", ["99999999999999", "100000000", "1025"])
def test_threads_beyond_the_bound_are_a_usage_error(tmp_path, threads):
    index = sharded(tmp_path / "ckpt")
    for command in (["report"], ["global", "--clip", "1", "--dry-run"], ["diff", index]):
        result = run(*command, "--threads", threads, index)
        assert result.exit_code == 2, result.output
        assert f"Invalid value for '--threads': {threads} is not in the range 1<=x<={MAX_THREADS}" in result.stderr


def test_the_command_line_bound_is_the_librarys():
    assert CLI_MAX_THREADS == MAX_THREADS == 1024


def test_the_library_clamps_threads_and_lays_out_a_huge_count_at_once():
    budget = Budget(256 * MiB, 10 ** 14)
    assert budget.workers == MAX_THREADS
    threads, inflight, block = budget.layout(4)
    assert 1 <= threads <= MAX_THREADS and inflight == threads + 2


def old_layout(budget: Budget, itemsize: int) -> tuple[int, int, int]:
    """The layout as it was computed one thread at a time (the reference for the closed form)."""
    threads = budget.workers
    scratch = UNIT_ELEMENTS * Scratch.BYTES_PER_ELEMENT
    unit_bytes = UNIT_ELEMENTS * max(1, itemsize)
    available = budget.memory - budget.memory // RESERVE_FRACTION
    inflight = threads + 2 if threads > 1 else 1
    while inflight > 1 and available - threads * scratch < inflight * min(unit_bytes, MiB):
        threads = max(1, threads - 1)
        inflight = threads + 2 if threads > 1 else 1
    block = (available - threads * scratch) // inflight
    block = max(min(unit_bytes, MiB), min(8 * MiB, block))
    return threads, inflight, block


@pytest.mark.parametrize("memory", [16 * MiB, 17 * MiB, 40 * MiB, 64 * MiB, 256 * MiB, 1 << 33])
@pytest.mark.parametrize("threads", [1, 2, 3, 7, 16, 64, 1000])
@pytest.mark.parametrize("itemsize", [1, 2, 4, 8])
def test_the_closed_form_layout_is_the_one_thread_at_a_time_layout(memory, threads, itemsize):
    budget = Budget(memory, threads)
    assert budget.layout(itemsize) == old_layout(budget, itemsize)


@pytest.mark.parametrize("memory_mib, threads, files", [(16, 16, 16), (16, 1, 16), (40, 16, 16), (64, 16, 3),
                                                          (256, 16, 16), (256, 64, 200), (1024, 8, 2)])
def test_files_in_parallel_share_one_budget(memory_mib, threads, files):
    """The files' passes that run at once take together at most --memory and --threads."""
    budget = Budget(memory_mib * MiB, threads)
    pool = TaskPool(budget, files, None)
    try:
        assert 1 <= pool.parallel <= min(files, threads)
        assert pool.parallel * pool.task_budget.memory <= budget.memory
        assert pool.parallel * pool.task_budget.workers <= threads
        assert pool.task_budget.memory >= MIN_MEMORY
    finally:
        pool.close()


def test_sixteen_shards_in_sixteen_megabytes_give_the_bits_of_a_serial_run(tmp_path):
    index = sharded(tmp_path / "ckpt", shards=12)
    tight = run("global", "--clip", "1", "--memory", "16M", "--threads", "16", "--out-dir", tmp_path / "a", index)
    serial = run("global", "--clip", "1", "--threads", "1", "--out-dir", tmp_path / "b", index)
    assert tight.exit_code == 0 and serial.exit_code == 0, tight.stderr + serial.stderr
    for shard in (tmp_path / "b").iterdir():
        assert (tmp_path / "a" / shard.name).read_bytes() == shard.read_bytes()
