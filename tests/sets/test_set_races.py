"""Runs that meet (issue 28.2, 28.3): two in-place runs on one set or file, a shard replaced
between pass 1 and pass 2, a pass-2 task run twice, a failed run's clean-up beside another
run's output. Each race is staged by a hook at the moment it is about, never by timing."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import numpy as np
import pytest

from support.cli import run
from support.formats_helpers import read_all, safetensors_bytes
from support.sets import TENSORS, sharded, single
from tclip.core.modes import GlobalNormClip
from tclip.errors import TclipError
from tclip.work.options import ClipOptions
from tclip.formats.sharded import TensorSet
from tclip.work.clip import clip_set
from tclip.work import clip as clip_module
from tclip.work import clip as tensorset  # where clipping a set runs its tasks


def global_norm(files) -> float:
    return math.sqrt(math.fsum(float(np.sum(np.square(a, dtype=np.float64)))
                               for f in files for a in read_all(f).values()))


def shards_of(folder):
    return sorted(folder.glob("model-*.safetensors"))


def contents(folder):
    """Every file of ``folder`` but the run's lock files (held while it runs)."""
    return {p.name: p.read_bytes() for p in folder.iterdir() if not p.name.endswith(".tclip-lock")}


def reference(tmp_path):
    """The shards one undisturbed in-place run gives."""
    clean = sharded(tmp_path / "clean")
    clip_set(TensorSet(str(clean), [], clean), GlobalNormClip(1.0), ClipOptions(in_place=True, threads=1))
    return {p.name: p.read_bytes() for p in shards_of(clean.parent)}


def test_a_second_in_place_run_on_a_set_being_rewritten_is_refused(tmp_path, monkeypatch):
    """Run B starts while run A sits between its passes: B must fail naming A, and A must
    finish with the set clipped once (before: both exited 0, the shards clipped twice)."""
    index = sharded(tmp_path / "ckpt")
    expected = reference(tmp_path)
    real_plan = tensorset.make_plan
    second, started = [], []

    def plan_then_another_run(*args, **kwargs):
        if not started:  # (once: the second run plans too, where nothing stops it)
            started.append(True)
            second.append(run("global", "--clip", "1", "--in-place", index))
        return real_plan(*args, **kwargs)

    monkeypatch.setattr(tensorset, "make_plan", plan_then_another_run)
    clip_set(TensorSet(str(index), [], index), GlobalNormClip(1.0), ClipOptions(in_place=True, threads=1))
    [refused] = second
    assert refused.exit_code == 1, refused.stderr
    assert refused.stderr.splitlines() == [
        f"Error: {index}: is being rewritten by another tclip run (pid {os.getpid()}); nothing was done (try again "
        "when it has finished)"]
    assert {p.name: p.read_bytes() for p in shards_of(index.parent)} == expected
    assert global_norm(shards_of(index.parent)) == pytest.approx(1.0, rel=1e-6)
    assert not [p.name for p in index.parent.iterdir() if p.name.startswith(".")]  # no lock file left


def test_a_second_run_on_one_file_in_place_is_refused(tmp_path, monkeypatch):
    path = single(tmp_path / "one")
    real_plan = clip_module.make_plan
    second, started = [], []

    def plan_then_another_run(*args, **kwargs):
        if not started:  # (once: the second run plans too, where nothing stops it)
            started.append(True)
            second.append(run("global", "--clip", "1", "--in-place", path))
        return real_plan(*args, **kwargs)

    monkeypatch.setattr(clip_module, "make_plan", plan_then_another_run)
    assert run("global", "--clip", "1", "--in-place", path).exit_code == 0
    [refused] = second
    assert refused.exit_code == 1
    assert f"{path}: is being rewritten by another tclip run (pid {os.getpid()})" in refused.stderr
    assert global_norm([path]) == pytest.approx(1.0, rel=1e-6)
    assert not [p.name for p in path.parent.iterdir() if p.name.startswith(".")]


def test_a_lock_left_by_a_killed_run_blocks_nothing(tmp_path):
    """flock locks die with their process; the file a kill leaves is taken over."""
    index = sharded(tmp_path / "ckpt")
    expected = reference(tmp_path)
    (index.parent / f".{index.name}.tclip-lock").write_text("999999999\n")
    result = run("global", "--clip", "1", "--in-place", index)
    assert result.exit_code == 0, result.stderr
    assert {p.name: p.read_bytes() for p in shards_of(index.parent)} == expected
    assert not [p.name for p in index.parent.iterdir() if p.name.startswith(".")]


def swap(shard):
    """Another program replaces ``shard`` by a new file (a clipped copy, as a racing run writes)."""
    data = read_all(shard)
    scaled = {name: (array * np.float32(0.5)).astype(array.dtype) for name, array in data.items()}
    temp = shard.with_name("swapped.tmp")
    temp.write_bytes(safetensors_bytes(scaled, metadata={"format": "pt"}))
    os.replace(temp, shard)
    return shard.read_bytes()


def test_a_shard_replaced_between_the_passes_is_refused_and_nothing_is_written(tmp_path, monkeypatch):
    index = sharded(tmp_path / "ckpt")
    victim = shards_of(index.parent)[1]
    real_plan = tensorset.make_plan
    planted = {}

    def plan_after_a_swap(*args, **kwargs):
        planted["bytes"] = swap(victim)
        planted["before"] = contents(index.parent)
        return real_plan(*args, **kwargs)

    monkeypatch.setattr(tensorset, "make_plan", plan_after_a_swap)
    result = run("global", "--clip", "1", "--in-place", index)
    assert result.exit_code == 1
    assert result.stderr.splitlines() == [
        f"Error: {victim}: was replaced or changed since tclip measured it (by another run or program); its plan "
        "is not this file's, so nothing was written to it"]
    assert contents(index.parent) == planted["before"]  # no shard rewritten, no journal, the index unmarked
    assert victim.read_bytes() == planted["bytes"]
    assert not [p.name for p in index.parent.iterdir() if p.name.startswith(".")]


def test_a_shard_replaced_while_pass_2_runs_is_not_rewritten(tmp_path, monkeypatch):
    """The swap lands after the run's check and before the shard's own task opens it."""
    index = sharded(tmp_path / "ckpt")
    originals = {p.name: p.read_bytes() for p in shards_of(index.parent)}
    expected = reference(tmp_path)
    victim = shards_of(index.parent)[2]
    real_task = tensorset.rewrite_task
    planted = {}

    def swap_then_rewrite(path, *args, **kwargs):
        if path == str(victim):
            planted["bytes"] = swap(victim)
        return real_task(path, *args, **kwargs)

    monkeypatch.setattr(tensorset, "rewrite_task", swap_then_rewrite)
    result = run("global", "--clip", "1", "--in-place", "--threads", "1", index)
    assert result.exit_code == 1
    assert f"Error: {victim}: was replaced or changed since tclip measured it" in result.stderr
    assert victim.read_bytes() == planted["bytes"]  # not scaled a second time
    for shard in shards_of(index.parent):
        if shard != victim:
            assert shard.read_bytes() in (originals[shard.name], expected[shard.name])


def test_a_task_run_twice_finds_its_shard_done_and_does_not_clip_it_again(tmp_path, monkeypatch):
    """What Dask does when a worker dies right after renaming its shard: the task runs
    again. The second attempt must find the shard clipped (its commit marker says so)."""
    index = sharded(tmp_path / "ckpt")
    expected = reference(tmp_path)
    real_task = tensorset.rewrite_task
    attempts = []

    def twice(*args, **kwargs):
        real_task(*args, **kwargs)  # this attempt's result is lost with its worker
        attempts.append(args[0])
        return real_task(*args, **kwargs)

    monkeypatch.setattr(tensorset, "rewrite_task", twice)
    result = run("global", "--clip", "1", "--in-place", "--json", index)
    assert result.exit_code == 0, result.stderr
    assert len(attempts) == 3
    assert {p.name: p.read_bytes() for p in shards_of(index.parent)} == expected
    data = json.loads(result.stdout)
    assert data["global_norm_after"] == pytest.approx(1.0, rel=1e-6)
    assert sum("its task ran again" in w for w in data["warnings"]) == 3
    assert not [p.name for p in index.parent.iterdir() if p.name.startswith(".")]


def test_a_value_clip_task_run_twice_does_not_claim_zero_changes(tmp_path, monkeypatch):
    index = sharded(tmp_path / "ckpt")
    real_task = tensorset.rewrite_task

    def twice(*args, **kwargs):
        real_task(*args, **kwargs)
        return real_task(*args, **kwargs)

    monkeypatch.setattr(tensorset, "rewrite_task", twice)
    result = run("value", "--min", "-0.5", "--max", "0.5", "--in-place", "--json", index)
    assert result.exit_code == 0, result.stderr
    tensors = json.loads(result.stdout)["tensors"]
    assert all(t["changed"] is None for t in tensors)  # not known: never a false 0
    assert max(float(np.max(np.abs(a))) for f in shards_of(index.parent) for a in read_all(f).values()) == 0.5


def test_a_failed_run_removes_only_what_it_wrote(tmp_path, monkeypatch):
    """Another run commits its output at a name this run planned, then this run fails: that
    output stays (before: the clean-up removed it by name); this run's own output goes."""
    a, b = single(tmp_path / "a"), single(tmp_path / "b", {f"stage1.{k}": v * 2 for k, v in TENSORS.items()})
    b = b.rename(tmp_path / "b" / "other.safetensors")
    out = tmp_path / "out"
    real_task = tensorset.rewrite_task

    def other_run_then_fail(path, work, target, *args, **kwargs):
        if path == str(b):
            (out / "other.safetensors").write_bytes(b"another run's finished output")
            raise TclipError("disk on fire", path)
        return real_task(path, work, target, *args, **kwargs)

    monkeypatch.setattr(tensorset, "rewrite_task", other_run_then_fail)
    result = run("global", "--clip", "1", "--across-files", "--threads", "1", "--out-dir", out, a, b)
    assert result.exit_code == 1 and "disk on fire" in result.stderr
    assert sorted(p.name for p in out.iterdir()) == ["other.safetensors"]
    assert (out / "other.safetensors").read_bytes() == b"another run's finished output"


@pytest.mark.slow  # a Dask cluster
def test_dask_reruns_the_task_of_a_worker_killed_right_after_its_rename(tmp_path):
    """The issue's own case, on a real cluster: each worker dies just after renaming its
    first shard; Dask reruns that task on a fresh worker, which must find the shard done
    (before: it clipped the clipped shard again, exit 0, global norm 0.913)."""
    distributed = pytest.importorskip("dask.distributed")
    index = sharded(tmp_path / "ckpt", shards=4)
    clean = sharded(tmp_path / "clean", shards=4)
    clip_set(TensorSet(str(clean), [], clean), GlobalNormClip(1.0), ClipOptions(in_place=True, threads=1))

    def die_after_the_first_rename():
        import os

        from tclip.formats import atomic

        real = atomic.AtomicOutput.commit

        def commit(self, marker=None):
            real(self, marker)
            if self.target.name.startswith("model-"):
                os._exit(137)  # killed right after the rename, before its result leaves

        atomic.AtomicOutput.commit = commit

    with distributed.LocalCluster(n_workers=2, threads_per_worker=1, processes=True, host="127.0.0.1",
                                  dashboard_address=":0", silence_logs=50) as local:
        with distributed.Client(local) as client:
            workers = client.run(os.getpid)
            # (the stack sampler is off in the tests' workers: see tests/conftest.py)
            assert not any(client.run(lambda: __import__("dask").config.get("distributed.worker.profile.enabled"))
                           .values())
            client.run(die_after_the_first_rename)  # (the workers that replace them are not)
            result = subprocess.run([sys.executable, "-m", "tclip", "global", "--clip", "1", "--json", "--dask",
                                     local.scheduler_address, "--in-place", str(index)],
                                    capture_output=True, text=True, timeout=300)
            assert set(client.run(os.getpid).values()).isdisjoint(workers.values())  # both died
    assert result.returncode == 0, result.stderr
    for shard in shards_of(index.parent):
        assert shard.read_bytes() == (clean.parent / shard.name).read_bytes()
    assert global_norm(shards_of(index.parent)) == pytest.approx(1.0, rel=1e-6)
    assert "its task ran again" in result.stdout
