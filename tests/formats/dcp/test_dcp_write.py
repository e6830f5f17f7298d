"""The clipping commands on a PyTorch Distributed Checkpoint (DCP) folder, writing a DCP folder.

The folders are written by the real ``torch.distributed.checkpoint`` in a child process
(:mod:`dcp_helpers`); the outputs are loaded back by ``torch.distributed.checkpoint`` in another
child process (tclip's own process never imports torch). The expected values are tclip's own
clip of the same tensors converted to one safetensors file: a DCP folder is clipped as any file.
"""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import numpy as np
import pytest

from support.cli import run
from support.dcp_helpers import expected, make_all
from tclip.formats.dcp import Reader
from tclip.formats.dcp.reader import DcpReader
from tclip.formats.dcp._metadata import load_dcp_metadata
from tclip.formats.safetensors import SafetensorsReader

CLIP = "0.5"  # far below every fixture's global norm: every selected tensor is clipped

_LOAD_BACK = """
import sys
from pathlib import Path
sys.path.insert(0, sys.argv[1])
import torch
from support.dcp_helpers import _dump, _load_back
_dump(torch, _load_back(torch, Path(sys.argv[2])), Path(sys.argv[3]))
"""


@pytest.fixture(scope="session")
def dcp_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    pytest.importorskip("torch")
    root = tmp_path_factory.mktemp("dcpw")
    make_all(root)
    return root


def load_back(folder: Path, dest: Path) -> tuple[dict[str, np.ndarray], dict]:
    """What ``torch.distributed.checkpoint`` loads from ``folder`` (in a child process): each
    tensor's bytes (uint8) by flat name, and the json of dtypes, shapes and plain values."""
    dest.mkdir()
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(OMP_NUM_THREADS="1")
    tests = Path(__file__).resolve().parents[2]
    subprocess.run([sys.executable, "-c", _LOAD_BACK, str(tests), str(folder), str(dest)], check=True, env=env,
                   timeout=300, capture_output=True)
    with np.load(dest / "expected.npz") as data:
        arrays = {name: data[name] for name in data.files}
    return arrays, json.loads((dest / "expected.json").read_text())


def clipped_by_safetensors(folder: Path, tmp: Path) -> dict[str, bytes]:
    """tclip's ``global --clip`` of the folder's weights converted to one safetensors file: each
    tensor's bytes by name (the values a DCP clip must hold, bit for bit)."""
    converted, clipped = tmp / "weights.safetensors", tmp / "weights.clipped.safetensors"
    result = run("convert", folder, converted)
    assert result.exit_code == 0, result.output
    result = run("global", converted, "--clip", CLIP, "-o", clipped)
    assert result.exit_code == 0, result.output
    with SafetensorsReader(clipped) as reader:
        return {name: reader.read(name).tobytes() for name in reader.tensors}


def items(folder: Path) -> dict[tuple[str, int | None], tuple[str, int, int]]:
    """Each storage_data item's place: (fqn, chunk index) -> (file, offset, length)."""
    meta = load_dcp_metadata((folder / ".metadata").read_bytes(), where=".metadata", path=folder)
    return {(i.fqn, i.index): (i.relative_path, i.offset, i.length) for i in meta.items}


def item_bytes(folder: Path, place: tuple[str, int, int]) -> bytes:
    file, offset, length = place
    with open(folder / file, "rb") as handle:
        handle.seek(offset)
        return handle.read(length)


def clip_into(folder: Path, out: Path, *more: object) -> None:
    result = run("global", folder, "--clip", CLIP, "--out-dir", out, *more)
    assert result.exit_code == 0, result.output


def check_layout(source: Path, out: Path, clipped: set[str], zips: bool = True) -> None:
    """The output folder holds the source's files at the same sizes, ``.metadata`` byte for byte;
    every item of a tensor not clipped (and every object item) is byte for byte the source's,
    and every clipped chunk is a zip whose CRC-32s hold (``zips``: the chunks are zips)."""
    assert sorted(p.name for p in out.iterdir()) == sorted(p.name for p in source.iterdir())
    for path in source.iterdir():
        assert (out / path.name).stat().st_size == path.stat().st_size, path.name
        assert (out / path.name).stat().st_mode == path.stat().st_mode, path.name  # (.metadata: not the folder's)
    assert (out / ".metadata").read_bytes() == (source / ".metadata").read_bytes()
    places = items(source)
    assert items(out) == places
    changed = 0
    for (fqn, index), place in places.items():
        before, after = item_bytes(source, place), item_bytes(out, place)
        if fqn not in clipped:
            assert after == before, fqn
            continue
        if zips:
            with zipfile.ZipFile(io.BytesIO(after)) as archive:
                assert archive.testzip() is None, fqn  # every member's CRC-32 is right
        changed += after != before
    assert changed or not clipped


# ----------------------------------------------------------------------------- torch loads the output back


@pytest.mark.parametrize("kind", ["single", "ranks2"])
def test_torch_loads_the_clipped_folder(dcp_root: Path, kind: str, tmp_path: Path) -> None:
    folder, arrays, meta = expected(dcp_root, kind)
    out = tmp_path / "out"
    clip_into(folder, out)
    want = clipped_by_safetensors(folder, tmp_path)
    got, got_meta = load_back(out, tmp_path / "back")
    assert set(got) == set(arrays) and got_meta["tensors"] == meta["tensors"]
    assert got_meta["others"] == meta["others"]  # the items saved as objects: step, lr, betas...
    clipped = set()
    for name, raw in got.items():
        if name in want and arrays[name].tobytes() != want[name]:
            clipped.add(name)
            assert raw.tobytes() == want[name], name  # the clipped values, bit for bit
        else:
            assert raw.tobytes() == arrays[name].tobytes(), name  # optimizer state, integers: untouched
    assert len(clipped) >= 5
    assert not any(name.startswith("optimizer.") for name in clipped)
    check_layout(folder, out, clipped)


def test_diff_names_the_clipped_tensors(dcp_root: Path, tmp_path: Path) -> None:
    folder, _, _ = expected(dcp_root, "ranks2")
    out = tmp_path / "out"
    clip_into(folder, out)
    result = run("diff", folder, out, "--json")
    report = json.loads(result.stdout.splitlines()[0])
    differing = {t["name"] for t in report["tensors"] if t["differs"]}
    assert report["same"] is False
    assert differing == {"model.layers.0.attention.wq.weight", "model.layers.0.feed_forward.w1.weight",
                         "model.layers.0.attention.wo.weight", "model.norm.weight", "model.scale"}


def test_include_clips_only_what_it_names(dcp_root: Path, tmp_path: Path) -> None:
    folder, arrays, _ = expected(dcp_root, "ranks2")
    out = tmp_path / "out"
    clip_into(folder, out, "--include", "model.layers.*")
    got, _ = load_back(out, tmp_path / "back")
    assert got["model.norm.weight"].tobytes() == arrays["model.norm.weight"].tobytes()
    assert got["model.layers.0.attention.wo.weight"].tobytes() != arrays["model.layers.0.attention.wo.weight"].tobytes()
    check_layout(folder, out, {"model.layers.0.attention.wq.weight", "model.layers.0.feed_forward.w1.weight",
                               "model.layers.0.attention.wo.weight"})


def test_value_clip_of_a_strided_chunk(dcp_root: Path, tmp_path: Path) -> None:
    """``lm_head.transposed`` is saved as a transposed view: its chunk's elements are strided."""
    folder, arrays, meta = expected(dcp_root, "single")
    out = tmp_path / "out"
    result = run("value", folder, "--min", "-0.1", "--max", "0.1", "--out-dir", out)
    assert result.exit_code == 0, result.output
    got, _ = load_back(out, tmp_path / "back")
    for name, info in meta["tensors"].items():
        if name.startswith("optimizer.") or info["dtype"] not in ("float32", "bfloat16"):
            assert got[name].tobytes() == arrays[name].tobytes(), name
            continue
        from tclip.formats.torch.pickled import TORCH_DTYPES

        dtype = TORCH_DTYPES[info["dtype"]]
        before = arrays[name].view(dtype).astype(np.float64)
        want = np.clip(before, -0.1, 0.1).astype(dtype)  # bounds are exact in float32; bf16 rounds them
        assert got[name].view(dtype).tobytes() == want.tobytes(), name


# ----------------------------------------------------------------------------- the SAFETENSORS variant


def test_safetensors_variant(dcp_root: Path, tmp_path: Path) -> None:
    folder, arrays, meta = expected(dcp_root, "safetensors")
    out = tmp_path / "out"
    clip_into(folder, out)
    want = clipped_by_safetensors(folder, tmp_path)
    clipped = set()
    with Reader(folder) as before, Reader(out) as after:
        assert set(after.tensors) == set(before.tensors)
        for name in before.tensors:
            old, new = before.read(name).tobytes(), after.read(name).tobytes()
            if name in want and old != want[name]:
                clipped.add(name)
                assert new == want[name], name
            else:
                assert new == old, name
    assert len(clipped) >= 5
    # only the clipped tensors' bytes differ: the embedded safetensors header and everything else stay
    source, written = (folder / "__0_0.distcp").read_bytes(), (out / "__0_0.distcp").read_bytes()
    assert len(source) == len(written)
    differ = np.flatnonzero(np.frombuffer(source, np.uint8) != np.frombuffer(written, np.uint8))
    with DcpReader(out) as reader:
        spans = []
        for name in clipped:
            reader.read(name)
            piece = reader.pieces[name][0]
            spans.append((piece.start, piece.start + reader.tensors[name].nbytes))
    assert all(any(a <= d < b for a, b in spans) for d in differ)
    assert (out / ".metadata").read_bytes() == (folder / ".metadata").read_bytes()


# ----------------------------------------------------------------------------- refused, nothing written


def test_zstd_items_are_refused(dcp_root: Path, tmp_path: Path) -> None:
    pytest.importorskip("zstandard")
    folder, _, _ = expected(dcp_root, "zstd")
    out = tmp_path / "out"
    result = run("global", folder, "--clip", CLIP, "--out-dir", out)
    assert result.exit_code == 1, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("Error: ") and "zstd" in lines[0], result.stderr
    assert "Traceback" not in result.output
    assert not out.exists()


def test_zstd_items_left_unselected_are_copied(dcp_root: Path, tmp_path: Path) -> None:
    """Only a clipped item must be rewritten: a zstd folder whose selection is empty is copied."""
    pytest.importorskip("zstandard")
    folder, _, _ = expected(dcp_root, "zstd")
    out = tmp_path / "out"
    result = run("norm", folder, "--clip", "1e6", "--out-dir", out)
    assert result.exit_code == 0, result.output
    check_layout(folder, out, set())


def test_in_place_is_refused(dcp_root: Path, tmp_path: Path) -> None:
    folder, _, _ = expected(dcp_root, "ranks2")
    before = {p.name: p.read_bytes() for p in folder.iterdir()}
    result = run("global", folder, "--clip", CLIP, "--in-place")
    assert result.exit_code == 1, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "--out-dir" in lines[0], result.stderr
    assert {p.name: p.read_bytes() for p in folder.iterdir()} == before


@pytest.mark.parametrize("name", ["hostile_metadata", "hostile_chunk", "overlap", "truncated", "missing_file"])
def test_a_refused_input_writes_nothing(dcp_root: Path, tmp_path: Path, name: str) -> None:
    out = tmp_path / "out"
    result = run("global", dcp_root / "broken" / name, "--clip", CLIP, "--out-dir", out)
    assert result.exit_code == 1, result.output
    assert result.stderr.count("Error: ") == 1 and "Traceback" not in result.output
    assert not out.exists()
    assert not (dcp_root / "broken" / name / "PWNED").exists()


def test_an_existing_chunk_file_stops_the_run(dcp_root: Path, tmp_path: Path) -> None:
    folder, _, _ = expected(dcp_root, "ranks2")
    out = tmp_path / "out"
    out.mkdir()
    (out / "__1_0.distcp").write_bytes(b"someone else's")
    result = run("global", folder, "--clip", CLIP, "--out-dir", out)
    assert result.exit_code == 1, result.output
    assert "__1_0.distcp" in result.stderr and "--force" in result.stderr
    assert sorted(p.name for p in out.iterdir()) == ["__1_0.distcp"]
    assert (out / "__1_0.distcp").read_bytes() == b"someone else's"
    clip_into(folder, out, "--force")
    check_layout(folder, out, {"model.layers.0.attention.wq.weight", "model.layers.0.feed_forward.w1.weight",
                               "model.layers.0.attention.wo.weight", "model.norm.weight", "model.scale"})


def test_two_step_folders_into_one_out_dir_are_refused(dcp_root: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    result = run("global", dcp_root / "single" / "ckpt", dcp_root / "ranks2" / "ckpt", "--clip", CLIP,
                 "--out-dir", out)
    assert result.exit_code == 1, result.output
    assert "would both be written" in result.stderr
    assert not out.exists() or not any(out.iterdir())


def test_a_dry_run_names_the_folder_and_writes_nothing(dcp_root: Path, tmp_path: Path) -> None:
    folder, _, _ = expected(dcp_root, "single")
    out = tmp_path / "out"
    result = run("global", folder, "--clip", CLIP, "--out-dir", out, "--dry-run")
    assert result.exit_code == 0, result.output
    assert not out.exists()


def test_without_an_output_folder_it_is_refused_before_reading(dcp_root: Path) -> None:
    folder, _, _ = expected(dcp_root, "ranks2")
    before = sorted(p.name for p in folder.iterdir())
    result = run("global", folder, "--clip", CLIP)
    assert result.exit_code == 1, result.output
    assert result.stderr.strip().splitlines() == [
        f"Error: {folder}: a DCP checkpoint is a folder: clip it into --out-dir DIR (its files keep their names)"]
    assert sorted(p.name for p in folder.iterdir()) == before


def test_the_report_counts_every_file_written(dcp_root: Path, tmp_path: Path) -> None:
    folder, _, _ = expected(dcp_root, "ranks2")
    out = tmp_path / "out"
    result = run("global", folder, "--clip", CLIP, "--out-dir", out, "--json")
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout.splitlines()[0])
    assert report["output"] == str(out / ".metadata")
    assert report["bytes_written"] == sum(p.stat().st_size for p in out.iterdir())


def test_the_folders_other_files_go_along(dcp_root: Path, tmp_path: Path) -> None:
    """Megatron and NeMo keep metadata.json (and common.pt) beside the DCP files: copied, as an
    index's config.json is; the .distcp files are written by the run, not copied over it."""
    import shutil

    folder = tmp_path / "iter_0000100"
    shutil.copytree(expected(dcp_root, "ranks2")[0], folder)
    (folder / "metadata.json").write_text('{"sharded_backend": "torch_dist"}')
    (folder / "extra").mkdir()
    out = tmp_path / "out"
    result = run("global", folder, "--clip", CLIP, "--out-dir", out)
    assert result.exit_code == 0, result.output
    assert "metadata.json" in result.stdout and "extra/ (a folder)" in result.stdout
    assert (out / "metadata.json").read_text() == '{"sharded_backend": "torch_dist"}'
    (folder / "metadata.json").unlink()
    (folder / "extra").rmdir()
    (out / "metadata.json").unlink()
    check_layout(folder, out, {"model.layers.0.attention.wq.weight", "model.layers.0.feed_forward.w1.weight",
                               "model.layers.0.attention.wo.weight", "model.norm.weight", "model.scale"})


def test_tensors_sharing_bytes_of_an_embedded_safetensors_file_are_refused_by_every_command(dcp_root: Path, tmp_path: Path) -> None:
    """A SAFETENSORS-variant folder whose header gives two tensors one byte range: clipping one would
    change the other, so neither is rewritten and nothing is written."""
    import shutil
    import struct

    folder = tmp_path / "shared"
    shutil.copytree(expected(dcp_root, "safetensors")[0], folder)
    data = bytearray((folder / "__0_0.distcp").read_bytes())
    # every tensor item's offset is the embedded file's start
    start = next(o for (_, index), (_, o, _) in items(folder).items() if index is not None)
    (length,) = struct.unpack("<Q", data[start:start + 8])
    header = json.loads(bytes(data[start + 8:start + 8 + length]))
    first, second = "layers.0.attention_norm.weight", "layers.1.attention_norm.weight"
    assert header[first]["shape"] == header[second]["shape"] and header[first]["dtype"] == header[second]["dtype"]
    header[second]["data_offsets"] = header[first]["data_offsets"]
    text = json.dumps(header, separators=(",", ":")).encode()
    assert len(text) <= length
    data[start + 8:start + 8 + length] = text.ljust(length)
    (folder / "__0_0.distcp").write_bytes(bytes(data))
    out = tmp_path / "out"
    result = run("global", folder, "--clip", CLIP, "--out-dir", out)
    assert result.exit_code == 1, result.output
    assert "overlapping data_offsets" in result.stderr and result.stderr.count("Error: ") == 1
    assert not out.exists()
    # read, the same bytes would be counted twice in the global norm: refused by every command
    for command in (["report"], ["info"], ["diff", folder]):
        result = run(command[0], folder, *command[1:])
        assert result.exit_code == 1 and "overlapping data_offsets" in result.stderr, (command, result.output)
        assert result.stderr.count("Error: ") == 1
