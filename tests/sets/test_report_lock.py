"""``report`` on a sharded checkpoint while another run rewrites it in place: an in-place run
replaces the shards one by one (each atomically, by rename), so a report reading them meanwhile
would add the old shards' norms to the new ones' -- a global norm of a checkpoint that never
existed. The report holds a shared lock on the index (as a run reading it into ``--out-dir``
does): a run rewriting the set in place and a report exclude each other, and either fails at once
naming the other; two reports share it, and it leaves nothing behind."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from support.cli import run
from support.sets import TENSORS, sharded
from tclip.core.modes import GlobalNormClip
from tclip.errors import TclipError
from tclip.formats.locks import RunLock
from tclip.formats.sharded import TensorSet
from tclip.work import sets as set_work
from tclip.work.clip import clip_set
from tclip.work.options import ClipOptions


def _global_norm(tensors: dict[str, np.ndarray]) -> float:
    return math.sqrt(math.fsum(float(np.sum(t.astype(np.float64) ** 2)) for t in tensors.values()))


def test_a_rewrite_in_place_cannot_start_while_a_report_reads_the_set(tmp_path, monkeypatch):
    index = sharded(tmp_path / "ckpt")
    before = {p.name: p.read_bytes() for p in index.parent.iterdir()}
    real = set_work.stats_task
    attempts: list[BaseException | None] = []

    def read_then_clip(*args, **kwargs):  # type: ignore[no-untyped-def]
        stats = real(*args, **kwargs)
        if not attempts:  # after the report's first shard, an in-place global clip of the same set
            try:
                clip_set(TensorSet(str(index), [], index), GlobalNormClip(1.0), ClipOptions(in_place=True, threads=1))
                attempts.append(None)
            except TclipError as error:
                attempts.append(error)
        return stats

    monkeypatch.setattr(set_work, "stats_task", read_then_clip)
    result = run("report", "--json", "--threads", "1", index)
    assert result.exit_code == 0, result.output
    assert len(attempts) == 1 and attempts[0] is not None, "the in-place clip ran while the report read the set"
    assert "is being rewritten by another tclip run" in str(attempts[0])
    assert json.loads(result.stdout)["global_norm"] == pytest.approx(_global_norm(TENSORS), rel=1e-12)
    assert {p.name: p.read_bytes() for p in index.parent.iterdir()} == before  # and no lock file left


def test_a_report_fails_at_once_while_a_run_rewrites_the_set_in_place(tmp_path):
    index = sharded(tmp_path / "ckpt")
    with RunLock(index):  # what an in-place run holds on the index from start to end
        result = run("report", index)
        assert result.exit_code == 1, result.output
        assert result.stderr.startswith(f"Error: {index}: is being rewritten by another tclip run")
        assert result.stdout == ""  # no numbers of a half-replaced set
    assert run("report", "-q", index).exit_code == 0


def test_two_reports_share_the_set(tmp_path):
    index = sharded(tmp_path / "ckpt")
    with RunLock(index, shared=True):  # another report, or a run reading the set into --out-dir
        result = run("report", "--json", index)
        assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["global_norm"] == pytest.approx(_global_norm(TENSORS), rel=1e-12)
    assert sorted(p.name for p in index.parent.iterdir()) == sorted(
        [index.name] + [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)])


def test_a_report_of_a_read_only_folder_needs_no_lock_file(tmp_path):
    index = sharded(tmp_path / "ckpt")
    index.parent.chmod(0o555)
    try:
        result = run("report", "-q", index)
    finally:
        index.parent.chmod(0o755)
    assert result.exit_code == 0, result.output


@pytest.mark.parametrize("command", ["diff", "convert"])
def test_diff_and_convert_read_a_set_under_the_same_lock(tmp_path, command):
    index = sharded(tmp_path / "ckpt")
    other = sharded(tmp_path / "other")
    args = [index, other] if command == "diff" else [index, tmp_path / "out.safetensors"]
    with RunLock(index):
        result = run(command, *args)
        assert result.exit_code == 1, result.output
        assert result.stderr.startswith(f"Error: {index}: is being rewritten by another tclip run"), result.stderr
        assert not (tmp_path / "out.safetensors").exists()
    with RunLock(other, shared=True):
        assert run(command, *args).exit_code == 0
    assert not list(index.parent.glob(".*")) and not list(other.parent.glob(".*"))  # no lock file left
