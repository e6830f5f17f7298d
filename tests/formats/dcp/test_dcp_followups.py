"""Follow-ups on DCP folders: ``info``'s size is the checkpoint's, ``diff`` compares the items
saved as objects by their stored bytes (and what metadata the folders hold), ``--out-dir`` on the
folder itself is told what to do, and an interrupted clip leaves no half checkpoint.

The folders are written by the real ``torch.distributed.checkpoint`` in a child process
(:mod:`dcp_helpers`); tclip's own process never imports torch.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from support.cli import run
from support.dcp_helpers import expected, make_all
from tclip.cli.render.table import human_bytes
from tclip.formats.dcp._metadata import load_dcp_metadata


@pytest.fixture(scope="session")
def fx_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    pytest.importorskip("torch")
    root = tmp_path_factory.mktemp("dcpf")
    make_all(root, ("single", "ranks2", "megatron", "zstd"))
    return root


def _copy(root: Path, kind: str, dest: Path) -> Path:
    folder, _, _ = expected(root, kind)
    shutil.copytree(folder, dest)
    return dest


def _items(folder: Path) -> dict[str, tuple[str, int, int]]:
    meta = load_dcp_metadata((folder / ".metadata").read_bytes(), where=".metadata", path=folder)
    return {i.fqn: (i.relative_path, i.offset, i.length) for i in meta.items if i.index is None}


# ------------------------------------------------------------------ 1. info's size


@pytest.mark.parametrize("kind", ["ranks2", "megatron"])
def test_info_size_is_the_whole_checkpoint(fx_root: Path, kind: str) -> None:
    folder, _, _ = expected(fx_root, kind)
    total = sum(p.stat().st_size for p in folder.iterdir() if p.is_file())
    assert total > 3 * (folder / ".metadata").stat().st_size  # (the old title's figure is far off)
    result = run("info", "--json", folder)
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["size_bytes"] == total
    title = run("info", folder / ".metadata").stdout.splitlines()[0]
    assert title == f"{folder}  (dcp, {human_bytes(total)})", title  # the folder, not its .metadata


# ------------------------------------------------------------------ 2. diff of items saved as objects


def test_diff_of_a_copy_is_same(fx_root: Path, tmp_path: Path) -> None:
    copy = _copy(fx_root, "single", tmp_path / "b")
    folder, _, _ = expected(fx_root, "single")
    result = run("diff", folder, copy)
    assert result.exit_code == 0, result.output
    assert "not compared" not in result.output and "metadata not compared" not in result.stderr
    data = json.loads(run("diff", "--json", folder, copy).stdout)
    lambdas = next(t for t in data["tensors"] if t["name"] == "lr_scheduler.lr_lambdas")
    assert lambdas["status"] == "compared" and "byte for byte" in lambdas["note"]


def test_diff_names_an_object_item_whose_bytes_differ(fx_root: Path, tmp_path: Path) -> None:
    copy = _copy(fx_root, "single", tmp_path / "b")
    folder, _, _ = expected(fx_root, "single")
    file, offset, length = _items(copy)["lr_scheduler.lr_lambdas"]
    data = bytearray((copy / file).read_bytes())
    at = offset + length // 2
    data[at] ^= 0xFF
    (copy / file).write_bytes(bytes(data))
    result = run("diff", "--json", folder, copy)
    assert result.exit_code == 3, result.output  # (diff's exit status for "differ" and "incomplete" alike)
    report = json.loads(result.stdout)
    lambdas = next(t for t in report["tensors"] if t["name"] == "lr_scheduler.lr_lambdas")
    assert lambdas["status"] == "compared" and lambdas["outside"] == 1
    others = [t for t in report["tensors"] if t["name"] != "lr_scheduler.lr_lambdas"]
    assert all(t["outside"] == 0 for t in others)
    assert report["verdict"] == "differ"


def test_zstd_items_are_compared_decompressed(fx_root: Path) -> None:
    """The same state saved with and without the ZStandard extension: its object items equal."""
    pytest.importorskip("zstandard")
    (plain, _, _), (packed, _, _) = expected(fx_root, "single"), expected(fx_root, "zstd")
    result = run("diff", "--json", plain, packed, "--exclude", "lm_head.transposed")  # (only the plain one has it)
    assert result.exit_code == 0, result.output
    lambdas = next(t for t in json.loads(result.stdout)["tensors"] if t["name"] == "lr_scheduler.lr_lambdas")
    assert lambdas["status"] == "compared" and lambdas["outside"] == 0


def test_diff_of_megatron_copies_is_same_and_compares_metadata_json(fx_root: Path, tmp_path: Path) -> None:
    folder, _, _ = expected(fx_root, "megatron")
    copy = _copy(fx_root, "megatron", tmp_path / "b")
    result = run("diff", folder, copy)
    assert result.exit_code == 0, result.output
    assert "metadata not compared" not in result.stderr
    config = json.loads((copy / "metadata.json").read_text())
    config["sharded_backend_version"] = 2
    (copy / "metadata.json").write_text(json.dumps(config))
    result = run("diff", "--json", folder, copy)
    assert result.exit_code == 3, result.output
    assert json.loads(result.stdout)["verdict"] == "differ"
    differences = json.loads(result.stdout)["metadata_differences"]
    assert [d["key"] for d in differences] == ["megatron.sharded_backend_version"], differences


def test_diff_names_a_changed_common_pt(fx_root: Path, tmp_path: Path) -> None:
    folder, _, _ = expected(fx_root, "megatron")
    copy = _copy(fx_root, "megatron", tmp_path / "b")
    data = bytearray((copy / "common.pt").read_bytes())
    data[len(data) // 3] ^= 0x01
    (copy / "common.pt").write_bytes(bytes(data))
    result = run("diff", "--json", folder, copy)
    assert result.exit_code == 3, result.output
    report = json.loads(result.stdout)
    assert report["verdict"] == "differ"
    assert [t["name"] for t in report["tensors"] if t["differs"]] == ["common.pt"]


def test_diff_compares_the_tensors_of_a_plain_common_pt(fx_root: Path, tmp_path: Path) -> None:
    """A common.pt the .pt allowlist reads: its tensors (an rng tracker's state) by their elements."""
    a = _copy(fx_root, "megatron", tmp_path / "a")
    shutil.copyfile(fx_root / "megatron" / "common_plain.pt", a / "common.pt")
    b = shutil.copytree(a, tmp_path / "b")
    result = run("diff", "--json", a, b)
    assert result.exit_code == 0, result.output
    rng = next(t for t in json.loads(result.stdout)["tensors"] if t["name"] == "common.pt/rng_tracker_states")
    assert rng["status"] == "compared" and rng["elements"] == 1 and rng["outside"] == 0


# ------------------------------------------------------------------ 3. --out-dir the folder itself


def test_out_dir_the_folder_itself_is_not_told_to_use_in_place(fx_root: Path, tmp_path: Path) -> None:
    copy = _copy(fx_root, "single", tmp_path / "step-100")
    before = {p.name: p.read_bytes() for p in copy.iterdir()}
    for source, args in ((copy, ("--out-dir", copy)), (copy / ".metadata", ("-o", copy / ".metadata"))):
        result = run("global", source, "--clip", "1", *args)
        assert result.exit_code == 1, result.output
        line = result.stderr.strip()
        assert len(line.splitlines()) == 1 and "--in-place replaces" not in line, line
        assert "another folder" in line and "not --in-place" in line, line
    assert {p.name: p.read_bytes() for p in copy.iterdir()} == before


# ------------------------------------------------------------------ 4. interrupted after the commit

_INTERRUPT = """
import os, signal, sys
import tclip.work.clip as clip
finish, signum = clip._finish_set_report, getattr(signal, sys.argv[1])
def interrupted(*args, **kwargs):
    finish(*args, **kwargs)
    os.kill(os.getpid(), signum)  # the writer committed; the run has not ended
clip._finish_set_report = interrupted
from tclip.cli.entry import main
sys.argv = ["tclip", *sys.argv[2:]]
main()
"""


@pytest.mark.parametrize("signame", ["SIGINT", "SIGTERM"])
def test_a_run_interrupted_after_the_commit_leaves_nothing(fx_root: Path, tmp_path: Path, signame: str) -> None:
    folder, _, _ = expected(fx_root, "ranks2")
    out = tmp_path / "clipped"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    done = subprocess.run([sys.executable, "-c", _INTERRUPT, signame, "global", str(folder), "--clip", "0.5",
                           "--out-dir", str(out)], capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 128 + getattr(signal, signame), (done.returncode, done.stderr)
    assert "Traceback" not in done.stderr
    assert sorted(p.name for p in out.iterdir()) == ["notes.txt"]


def test_a_run_interrupted_after_the_commit_keeps_what_force_replaced(fx_root: Path, tmp_path: Path) -> None:
    """With --force over an older clip, the old files are replaced (never restored): what is left
    is the new checkpoint whole, never a .metadata without its .distcp files."""
    folder, _, _ = expected(fx_root, "ranks2")
    out = tmp_path / "clipped"
    assert run("global", folder, "--clip", "2", "--out-dir", out).exit_code == 0
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    done = subprocess.run([sys.executable, "-c", _INTERRUPT, "SIGINT", "global", str(folder), "--clip", "0.5",
                           "--out-dir", str(out), "--force"], capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 130, done.stderr
    names = sorted(p.name for p in out.iterdir())
    assert names == sorted(p.name for p in folder.iterdir()), names
    assert run("report", out).exit_code == 0
