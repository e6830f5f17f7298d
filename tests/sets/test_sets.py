"""One tensor set across many files: sharded checkpoints, --across-files, local parallel, Dask (issue 10)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import h5py
import numpy as np
import pytest

from support.cli import run
from support.formats_helpers import read_all, safetensors_bytes
from support.sets import RNG, TENSORS, all_tensors, interrupted, sharded, single
from tclip.core.modes import GlobalNormClip
from tclip.errors import TclipError
from tclip.work.clip import clip_file
from tclip.work.options import ClipOptions
from tclip.formats.sharded import TensorSet, load_index
from tclip.work.clip import clip_set
from tclip.work import clip as tensorset  # where clipping a set runs its tasks

@pytest.mark.parametrize("threads", [1, 3])
def test_index_global_clip_equals_the_single_file_to_the_last_bit(tmp_path, threads):
    index = sharded(tmp_path / "ckpt")
    result = run("global", "--clip", "1", "--threads", threads, "--out-dir", tmp_path / "out", index)
    assert result.exit_code == 0, result.stderr
    reference = clip_file(single(tmp_path / "one"), GlobalNormClip(1.0))
    got = all_tensors(tmp_path / "out")
    want = read_all(tmp_path / "one" / "all.clipped.safetensors")
    assert set(got) == set(want)
    assert all(got[n].tobytes() == want[n].tobytes() for n in want)
    data = json.loads((tmp_path / "out" / "model.safetensors.index.json").read_text())
    assert data["metadata"]["total_size"] == sum(t.nbytes for t in TENSORS.values())  # recomputed, not copied
    assert data["weight_map"] == json.loads(index.read_text())["weight_map"]
    summary = json.loads(run("global", "--clip", "1", "--dry-run", "--json", index).stdout)
    assert summary["global_norm"] == reference.global_norm
    from safetensors.numpy import load_file

    for shard in (tmp_path / "out").glob("model-*.safetensors"):
        assert set(load_file(str(shard))) <= set(TENSORS)  # the safetensors library reads every shard


def test_a_directory_holding_an_index_is_the_set(tmp_path):
    sharded(tmp_path / "ckpt")
    result = run("report", "--json", tmp_path / "ckpt")
    assert result.exit_code == 0, result.stderr
    data = json.loads(result.stdout)
    assert len(data["tensors"]) == len(TENSORS) and len(data["files"]) == 3


def test_per_tensor_modes_and_report_over_an_index(tmp_path):
    index = sharded(tmp_path / "ckpt")
    assert run("norm", "--clip", "5", "--axes", "1", "--out-dir", tmp_path / "out", index).exit_code == 0
    got = all_tensors(tmp_path / "out")
    import tclip

    for name, array in TENSORS.items():
        assert got[name].tobytes() == tclip.clip_by_norm(array, 5.0, axes=1).tobytes()
    report = json.loads(run("report", "--json", index).stdout)
    one = json.loads(run("report", "--json", single(tmp_path / "one")).stdout)
    assert report["global_norm"] == one["global_norm"]
    info = run("info", index)
    assert info.exit_code == 0 and "model.layers.5.mlp.down.weight" in info.stdout and "shards" in info.stdout


def test_an_index_needs_an_output_folder_or_in_place(tmp_path):
    index = sharded(tmp_path / "ckpt")
    result = run("global", "--clip", "1", index)
    assert result.exit_code == 1 and "needs --out-dir" in result.stderr


def test_index_errors_name_tensor_and_files(tmp_path):
    index = sharded(tmp_path / "ckpt")
    data = json.loads(index.read_text())
    data["weight_map"]["ghost.weight"] = "model-00002-of-00003.safetensors"
    index.write_text(json.dumps(data))
    result = run("report", index)
    assert result.exit_code == 1
    assert "maps tensor 'ghost.weight' to model-00002-of-00003.safetensors, which does not hold it" in result.stderr
    twice = tmp_path / "twice"
    index = sharded(twice)
    first = twice / "model-00001-of-00003.safetensors"
    extra = read_all(first)
    extra["lm_head.weight"] = TENSORS["lm_head.weight"]
    first.write_bytes(safetensors_bytes(extra))
    result = run("report", index)
    assert result.exit_code == 1 and "tensor 'lm_head.weight' is in two files" in result.stderr
    data = json.loads(index.read_text())
    data["weight_map"]["lm_head.weight"] = "../elsewhere.safetensors"
    index.write_text(json.dumps(data))
    with pytest.raises(TclipError, match="outside the index's folder"):
        load_index(index)


def test_across_files_of_mixed_formats(tmp_path):
    names = list(TENSORS)
    np.savez(tmp_path / "stage0.npz", **{n: TENSORS[n] for n in names[:5]})
    (tmp_path / "stage1.safetensors").write_bytes(safetensors_bytes({n: TENSORS[n] for n in names[5:10]}))
    with h5py.File(tmp_path / "stage2.h5", "w") as f:
        for n in names[10:]:
            f.create_dataset(n, data=TENSORS[n])
    files = [tmp_path / "stage0.npz", tmp_path / "stage1.safetensors", tmp_path / "stage2.h5"]
    result = run("global", "--clip", "1", "--across-files", *files)
    assert result.exit_code == 0, result.stderr
    got = {}
    for f in ("stage0.clipped.npz", "stage1.clipped.safetensors", "stage2.clipped.h5"):
        got.update(read_all(tmp_path / f))
    clip_file(single(tmp_path / "one"), GlobalNormClip(1.0))
    want = read_all(tmp_path / "one" / "all.clipped.safetensors")
    assert all(got[n].tobytes() == want[n].tobytes() for n in want)
    np.savez(tmp_path / "dup.npz", **{names[0]: TENSORS[names[0]]})
    result = run("global", "--clip", "1", "--across-files", "--dry-run", files[0], tmp_path / "dup.npz")
    assert result.exit_code == 1 and f"tensor {names[0]!r} is in two files" in result.stderr
    assert "stage0.npz" in result.stderr and "dup.npz" in result.stderr


def test_in_place_marks_the_index_and_resumes_after_a_crash(tmp_path, monkeypatch):
    index = sharded(tmp_path / "ckpt")
    clean = sharded(tmp_path / "clean")
    clip_set(TensorSet(str(clean), [], clean), GlobalNormClip(1.0), ClipOptions(in_place=True))
    real = tensorset.rewrite_task
    calls = []

    def crash_on_second(*args, **kwargs):
        calls.append(args[0])
        if len(calls) == 2:
            raise KeyboardInterrupt  # the run dies here
        return real(*args, **kwargs)

    monkeypatch.setattr(tensorset, "rewrite_task", crash_on_second)
    with pytest.raises(KeyboardInterrupt):
        clip_set(TensorSet(str(index), [], index), GlobalNormClip(1.0), ClipOptions(in_place=True, threads=1))
    journal = index.with_name(index.name + ".tclip-journal")
    assert journal.exists()
    assert "tclip_in_progress" in json.loads(index.read_text())["metadata"]  # the index says so
    monkeypatch.setattr(tensorset, "rewrite_task", real)
    report = clip_set(TensorSet(str(index), [], index), GlobalNormClip(1.0), ClipOptions(in_place=True))
    assert any("resumed an unfinished run" in w for w in report.warnings)
    assert not journal.exists()
    assert "tclip_in_progress" not in json.loads(index.read_text())["metadata"]
    for shard in sorted((tmp_path / "ckpt").glob("model-*.safetensors")):
        assert shard.read_bytes() == (tmp_path / "clean" / shard.name).read_bytes()
    assert index.read_bytes() == clean.read_bytes()  # total_size over every shard, not the resumed ones
    assert not list((tmp_path / "ckpt").glob("*.tclip-tmp"))


def test_a_kill_between_a_shards_rename_and_its_journal_record_still_resumes(tmp_path):
    """SIGKILL at the worst moment: the first shard is renamed into place, the journal
    does not say so yet. The rerun must count it done, not refuse it as changed."""
    index = sharded(tmp_path / "ckpt")
    clean = sharded(tmp_path / "clean")
    clip_set(TensorSet(str(clean), [], clean), GlobalNormClip(1.0), ClipOptions(in_place=True))
    driver = (
        "import os, sys, threading\n"
        "from tclip.work import clip as sets\n"
        "real, calls = sets.rewrite_task, []\n"
        "def first_only(*args, **kwargs):\n"
        "    calls.append(args[0])\n"
        "    if len(calls) > 1:  # later shards wait: exactly one is renamed when the run dies, however busy\n"
        "        threading.Event().wait()  # the machine (the worker thread never outruns the kill)\n"
        "    return real(*args, **kwargs)\n"
        "sets.rewrite_task = first_only\n"
        "sets.journal_done = lambda journal, tensor_set, file: os._exit(137)  # killed right after the rename\n"
        "from tclip.cli import cli\n"
        "cli(['global', '--clip', '1', '--in-place', '--threads', '1', sys.argv[1]])\n"
    )
    killed = subprocess.run([sys.executable, "-c", driver, str(index)], capture_output=True, text=True)
    assert killed.returncode == 137, killed.stderr
    shards = sorted((tmp_path / "ckpt").glob("model-*.safetensors"))
    replaced = [s for s in shards if s.read_bytes() == (tmp_path / "clean" / s.name).read_bytes()]
    assert len(replaced) == 1  # exactly the window this test is about
    result = run("global", "--clip", "1", "--in-place", index)
    assert result.exit_code == 0, result.stderr
    for shard in shards:
        assert shard.read_bytes() == (tmp_path / "clean" / shard.name).read_bytes()
    assert not [p.name for p in (tmp_path / "ckpt").iterdir() if p.name.startswith(".")]
    assert index.read_bytes() == clean.read_bytes()


def test_a_journal_of_other_parameters_is_refused(tmp_path, monkeypatch):
    index = sharded(tmp_path / "ckpt")

    def crash(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(tensorset, "rewrite_task", crash)
    with pytest.raises(KeyboardInterrupt):
        clip_set(TensorSet(str(index), [], index), GlobalNormClip(1.0), ClipOptions(in_place=True))
    monkeypatch.undo()
    result = run("global", "--clip", "2", "--in-place", index)
    assert result.exit_code == 1 and "an unfinished global run with other parameters" in result.stderr


# ------------------------------------------------------------------ Dask


@pytest.fixture(scope="module")
def cluster():
    distributed = pytest.importorskip("dask.distributed")
    # dashboard on a free port (None still takes 8787, and fails where another cluster has it)
    with distributed.LocalCluster(n_workers=2, threads_per_worker=1, processes=True, host="127.0.0.1",
                                  dashboard_address=":0", silence_logs=50) as local:
        with distributed.Client(local) as client:
            yield local, client


@pytest.mark.slow  # a Dask cluster
def test_the_cli_on_a_dask_cluster_gives_the_same_bytes(tmp_path, cluster):
    local, _ = cluster
    index = sharded(tmp_path / "ckpt")
    result = subprocess.run([sys.executable, "-m", "tclip", "global", "--clip", "1", "--dask",
                             local.scheduler_address, "--out-dir", str(tmp_path / "out"), str(index)],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    reference = sharded(tmp_path / "ref")
    run("global", "--clip", "1", "--threads", "1", "--out-dir", tmp_path / "refout", reference)
    for shard in (tmp_path / "refout").glob("*.safetensors"):
        assert (tmp_path / "out" / shard.name).read_bytes() == shard.read_bytes()


@pytest.mark.slow  # a Dask cluster
def test_relative_paths_reach_workers_started_in_another_folder(tmp_path, cluster):
    """The client resolves paths before they leave it: a worker reads them against its own folder."""
    local, client = cluster
    assert set(client.run(os.getcwd).values()) != {str(tmp_path)}
    sharded(tmp_path / "ckpt")
    for command in (["global", "--clip", "1", "--out-dir", "out"], ["norm", "--clip", "1", "--out-dir", "pern"],
                    ["global", "--clip", "1", "--in-place"]):
        result = subprocess.run([sys.executable, "-m", "tclip", *command, "--dask", local.scheduler_address,
                                 "ckpt/model.safetensors.index.json"], cwd=tmp_path, capture_output=True, text=True,
                                timeout=300)
        assert result.returncode == 0, (command, result.stderr)
    reference = sharded(tmp_path / "ref")
    run("global", "--clip", "1", "--threads", "1", "--out-dir", tmp_path / "refout", reference)
    for shard in (tmp_path / "refout").glob("*.safetensors"):
        assert (tmp_path / "out" / shard.name).read_bytes() == shard.read_bytes()
    assert sorted(p.name for p in (tmp_path / "pern").iterdir()) == sorted(p.name for p in (tmp_path / "out").iterdir())
    for shard in (tmp_path / "refout").glob("*.safetensors"):
        assert (tmp_path / "ckpt" / shard.name).read_bytes() == shard.read_bytes()  # the in-place run


@pytest.mark.slow  # a Dask cluster
def test_a_worker_killed_mid_run_leaves_every_shard_old_or_new(tmp_path, cluster):
    local, client = cluster
    big = {f"layers.{i}.w": (RNG.standard_normal((1024, 1024)) * (i + 1)).astype(np.float32) for i in range(8)}
    index = sharded(tmp_path / "ckpt", big, shards=8)
    originals = {p.name: p.read_bytes() for p in (tmp_path / "ckpt").glob("*.safetensors")}
    paused = tmp_path / "paused"
    paused.mkdir()

    def pause_before_a_shards_rename(folder):
        """In a worker: each shard's output, written whole, waits before its rename (and says
        so with a file named by the worker's pid) until the test kills the worker there."""
        import os
        import time
        from pathlib import Path

        from tclip.formats import atomic

        real = atomic.AtomicOutput.commit

        def commit(self, marker=None):
            if self.target.name.startswith("model-"):
                (Path(folder) / str(os.getpid())).write_text(str(self.target))
                time.sleep(600)
            return real(self, marker)

        atomic.AtomicOutput.commit = commit

    workers = client.run(os.getpid)
    client.run(pause_before_a_shards_rename, str(paused))  # the workers a killed one is replaced by are not
    process = subprocess.Popen([sys.executable, "-m", "tclip", "global", "--clip", "1", "--dask",
                                local.scheduler_address, "--in-place", str(index)],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    killed: set[int] = set()
    deadline = time.monotonic() + 300
    # Both workers get a shard (one blocked leaves the other every task) and stop before its
    # rename: each is killed exactly there, mid-write, and Dask reruns its task on a fresh worker.
    while len(killed) < len(workers) and process.poll() is None and time.monotonic() < deadline:
        for marker in paused.iterdir():
            if int(marker.name) not in killed:
                assert int(marker.name) in workers.values()
                os.kill(int(marker.name), signal.SIGKILL)
                killed.add(int(marker.name))
        time.sleep(0.01)
    assert killed == set(workers.values())
    out, err = process.communicate(timeout=300)
    assert process.returncode in (0, 1), err
    assert "Traceback" not in err
    reference = sharded(tmp_path / "ref", big, shards=8)
    run("global", "--clip", "1", "--threads", "1", "--out-dir", tmp_path / "refout", reference)
    for shard in (tmp_path / "ckpt").glob("model-*.safetensors"):
        data = shard.read_bytes()
        new = (tmp_path / "refout" / shard.name).read_bytes()
        assert data in (originals[shard.name], new)  # never half-written
        if process.returncode == 0:
            assert data == new
    client.wait_for_workers(len(workers))


def test_diff_takes_an_index_or_its_directory_on_either_side(tmp_path):
    index = sharded(tmp_path / "ckpt")
    one = single(tmp_path / "one")
    same = run("diff", "--json", index, one)
    assert same.exit_code == 0, same.output
    assert json.loads(same.stdout)["tensors_compared"] == len(TENSORS)
    assert run("global", "--clip", "1", "--out-dir", tmp_path / "out", index).exit_code == 0
    moved = run("diff", "--json", tmp_path / "ckpt", tmp_path / "out")
    assert moved.exit_code == 3, moved.output
    report = json.loads(moved.stdout)
    clipped = all_tensors(tmp_path / "out")
    expected = np.sqrt(sum(np.sum((TENSORS[n].astype(np.float64) - clipped[n].astype(np.float64)) ** 2)
                           for n in TENSORS))
    assert report["tensors_differing"] == sum(bool(np.any(TENSORS[n] != clipped[n])) for n in TENSORS)
    assert report["global_diff_norm"] == pytest.approx(expected, rel=1e-12)
    (tmp_path / "empty").mkdir()
    refused = run("diff", tmp_path / "empty", index)
    assert refused.exit_code == 1
    assert refused.stderr.startswith("Error: ") and "index" in refused.stderr


def test_a_dry_run_in_place_writes_nothing_not_even_a_journal(tmp_path):
    index = sharded(tmp_path / "ckpt")
    before = {p.name: p.read_bytes() for p in (tmp_path / "ckpt").iterdir()}
    result = run("global", "--clip", "1", "--in-place", "--dry-run", index)
    assert result.exit_code == 0, result.stderr
    assert {p.name: p.read_bytes() for p in (tmp_path / "ckpt").iterdir()} == before


def test_a_half_clipped_checkpoint_is_never_clipped_anew(tmp_path, monkeypatch):
    index, _ = interrupted(tmp_path, monkeypatch)
    report = run("report", index)
    assert report.exit_code == 0 and "an in-place run was interrupted here" in report.stderr
    elsewhere = run("global", "--clip", "1", "--out-dir", tmp_path / "out", index)
    assert elsewhere.exit_code == 1 and "some shards may be clipped and others not" in elsewhere.stderr
    assert not (tmp_path / "out").exists()
    journal = index.with_name(index.name + ".tclip-journal")
    kept = journal.read_bytes()
    journal.unlink()
    lost = run("global", "--clip", "1", "--in-place", index)
    assert lost.exit_code == 1 and "journal" in lost.stderr and "missing" in lost.stderr
    journal.write_bytes(kept)
    assert run("global", "--clip", "1", "--in-place", index).exit_code == 0
    assert "tclip_in_progress" not in json.loads(index.read_text())["metadata"]
