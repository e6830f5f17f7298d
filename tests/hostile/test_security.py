"""Hostile files: tclip never writes anything but its own output, and never replaces one it must not."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import h5py
import numpy as np
import pytest
from click.testing import CliRunner

from support.cli import run
from support.helpers import PickleTrap
from tclip.cli import cli
from tclip.cli.words import flag
from tclip.core.modes import NormClip
from tclip.errors import OutputExistsError, TclipError
from tclip.formats import create_writer, open_reader
from tclip.work.clip import clip_file
from tclip.work.options import ClipOptions


def snapshot(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.fixture
def external(tmp_path, monkeypatch):
    """evil.h5 whose dataset 'a' keeps its data in victim.bin (HDF5 resolves it from the working directory)."""
    monkeypatch.chdir(tmp_path)
    victim = tmp_path / "victim.bin"
    victim.write_bytes(np.arange(64, dtype=np.float32).tobytes())
    with h5py.File(tmp_path / "evil.h5", "w") as f:
        f.create_dataset("a", shape=(64,), dtype="f4", external=[("victim.bin", 0, 256)])
        f.create_dataset("b", data=np.full(8, 3.0, np.float32))
    return tmp_path / "evil.h5"


@pytest.mark.parametrize("how", [[], ["-o", "out.h5"], ["--out-dir", "out"], ["--in-place"], ["--dry-run"]])
def test_external_storage_is_refused_and_never_written(external, how):
    folder = external.parent
    (folder / "out").mkdir()
    before = snapshot(folder)
    result = run("norm", "--clip", "1", *how, external)
    assert result.exit_code == 1, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"Error: {external}: tensor 'a':")
    assert "external storage" in lines[0] and "'victim.bin'" in lines[0] and "--exclude" in lines[0]
    assert snapshot(folder) == before  # victim.bin, the input and every folder untouched


def test_external_storage_left_out_with_exclude(external):
    victim = external.parent / "victim.bin"
    before = victim.read_bytes()
    result = run("norm", "--clip", "1", "--exclude", "a", external)
    assert result.exit_code == 0, result.stderr
    assert victim.read_bytes() == before
    with h5py.File(external.with_name("evil.clipped.h5"), "r") as f:
        np.testing.assert_allclose(np.linalg.norm(f["b"][()]), 1.0, rtol=1e-6)


def test_report_lists_external_storage_as_skipped_without_reading_it(external):
    report = run("report", "--json", external)
    assert report.exit_code == 0, report.stderr
    import json
    tensors = {t["name"]: t for t in json.loads(report.stdout)["tensors"]}
    assert tensors["a"]["norm"] is None and "external storage" in tensors["a"]["skipped"]
    assert tensors["b"]["norm"] == pytest.approx(np.sqrt(8 * 9.0))
    with open_reader(external) as reader, pytest.raises(TclipError, match="external storage"):
        reader.read("a")


@pytest.fixture
def virtual(tmp_path):
    source = tmp_path / "src.h5"
    with h5py.File(source, "w") as f:
        f.create_dataset("data", data=np.full((4, 8), 10.0, np.float32))
    layout = h5py.VirtualLayout(shape=(4, 8), dtype="f4")
    layout[:] = h5py.VirtualSource(str(source), "data", shape=(4, 8))
    with h5py.File(tmp_path / "vds.h5", "w") as f:
        f.create_virtual_dataset("v", layout, fillvalue=0)
    return tmp_path / "vds.h5"


def test_virtual_dataset_is_refused_and_its_source_untouched(virtual):
    folder = virtual.parent
    (folder / "out").mkdir()
    before = snapshot(folder)
    result = run("norm", "--clip", "1", "--out-dir", folder / "out", virtual)
    assert result.exit_code == 1
    assert "tensor 'v': virtual dataset" in result.stderr and "src.h5" in result.stderr
    assert snapshot(folder) == before
    assert not (folder / "out" / "vds.h5").exists()


def test_output_that_appears_while_writing_is_never_replaced(tmp_path):
    np.save(tmp_path / "a.npy", np.ones(3, np.float32))
    target = tmp_path / "out.npy"
    with open_reader(tmp_path / "a.npy") as reader:
        writer = create_writer(target, reader)
        for index in writer.blocks("a"):
            writer.write("a", index, reader.read("a", index))
        target.write_bytes(b"someone else's file")  # after the existence check, before the commit
        with pytest.raises(OutputExistsError) as refused:
            writer.commit()
        assert "pass --force" in refused.value.spelled(flag)  # as the command line says it
    assert target.read_bytes() == b"someone else's file"
    assert sorted(os.listdir(tmp_path)) == ["a.npy", "out.npy"]  # no temporary file left


def test_concurrent_runs_on_one_output_never_both_succeed(tmp_path):
    np.savez(tmp_path / "g.npz", w=np.full((64, 64), 3.0, np.float32))
    for attempt in range(20):
        target = tmp_path / f"out{attempt}.npz"
        outcomes: list[str] = []
        barrier = threading.Barrier(2)

        def work() -> None:
            barrier.wait()
            try:
                clip_file(tmp_path / "g.npz", NormClip(1.0), ClipOptions(output=target))
                outcomes.append("ok")
            except OutputExistsError:
                outcomes.append("exists")

        threads = [threading.Thread(target=work) for _ in range(2)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        assert sorted(outcomes) == ["exists", "ok"], attempt
    assert not [p for p in os.listdir(tmp_path) if p.endswith(".tclip-tmp")]



@pytest.mark.parametrize("save", [np.savez, np.savez_compressed], ids=["stored", "deflated"])
def test_a_pickled_npz_member_is_carried_and_never_unpickled(tmp_path, save):
    trap = tmp_path / "pickle-ran"
    source = tmp_path / "g.npz"
    objects = np.empty(1, dtype=object)
    objects[0] = PickleTrap(str(trap))
    save(source, w=np.full((4, 4), 3.0, np.float32), objects=objects)
    before = source.read_bytes()
    for args in (["info", "--json"], ["report", "--json"], ["diff", source], ["norm", "--clip", "1"],
                 ["global", "--clip", "1", "-o", tmp_path / "g.safetensors"]):
        result = CliRunner().invoke(cli, [*map(str, args), str(source)])
        assert result.exit_code in (0, 1), result.output
        assert not trap.exists()
    assert source.read_bytes() == before
    import zipfile

    with zipfile.ZipFile(source) as a, zipfile.ZipFile(tmp_path / "g.clipped.npz") as b:
        assert b.read("objects.npy") == a.read("objects.npy")  # byte for byte
        assert b.namelist() == a.namelist()
    assert not (tmp_path / "g.safetensors").exists()  # safetensors cannot hold it: refused, nothing written
    assert not trap.exists()
