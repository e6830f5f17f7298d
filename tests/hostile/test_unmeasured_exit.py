"""No command exits 0 over a selected tensor it could not read when that tensor may hold floats: every
format's "tclip cannot read this type" (a GGUF tensor of an unknown ggml type, a safetensors F4
tensor, HDF5 quad floats, a ``torch.float4_e2m1fn_x2`` tensor, an npz member of raw bytes -- what
``np.savez`` writes for a bfloat16 array) and a float tensor it refuses to read (HDF5 external
storage), each beside a float tensor it reads, under every clip, the ``--max-norm`` gate and diff.

A clip refuses (exit 1, nothing written, the tensor named, ``--exclude`` offered), as it refuses a
quantized weight it does not understand; the gate and diff say "not measured" / "not compared" (exit 3).
A type known to hold no floats (``torch.complex32``) is carried by a clip, as complex tensors are
(tests/core/test_numeric_edges.py)."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import h5py
import ml_dtypes
import numpy as np
import pytest

from support import gguf_helpers as gh
from support.cli import run80 as run

WEIGHT = "model.layers.0.mlp.up_proj.weight"
ODD = "model.layers.0.mlp.down_proj.weight"


def _gguf(folder: Path, odd: int = 1) -> Path:
    path = folder / "model.gguf"
    gh.write_gguf(path, gh.GgufSpec(tensors=[
        gh.Tensor("blk.0.ffn_up.weight", (2, 256), 0, np.full(512, 0.5, np.float32).tobytes()),
        gh.Tensor("blk.0.ffn_down.weight", (4,), 99, b"", offset=2048)]))  # a type ggml does not define
    with open(path, "ab") as handle:
        handle.write(bytes(64))
    return path


def _safetensors_f4(folder: Path, odd: int = 1) -> Path:
    path = folder / "model.safetensors"
    header = json.dumps({ODD: {"dtype": "F4", "shape": [4], "data_offsets": [0, 2]},
                         WEIGHT: {"dtype": "F32", "shape": [2], "data_offsets": [2, 10]}}).encode()
    header += b" " * (-len(header) % 8)
    path.write_bytes(len(header).to_bytes(8, "little") + header + bytes([odd, 0x34]) +
                     np.array([3, 4], np.float32).tobytes())
    return path


def _hdf5(folder: Path, make: Callable[[h5py.File, Path], None]) -> Path:
    path = folder / "model.h5"
    with h5py.File(path, "w") as f:
        f.create_dataset(WEIGHT, data=np.full((4, 4), 0.5, np.float32))
        make(f, folder)
    return path


def _hdf5_quad(folder: Path, odd: int = 1) -> Path:
    return _hdf5(folder, lambda f, _: f.create_dataset(ODD, data=np.arange(3.0, dtype=np.longdouble) * odd))


def _hdf5_external(folder: Path, odd: int = 1) -> Path:
    stored = folder / "stored.bin"
    stored.write_bytes(np.full(64, 1e6 * odd, np.float32).tobytes())
    return _hdf5(folder, lambda f, _: f.create_dataset(ODD, shape=(64,), dtype="f4", external=[(str(stored), 0, 256)]))


def _npz_raw_bfloat16(folder: Path, odd: int = 1) -> Path:
    path = folder / "model.npz"
    # np.savez records ml_dtypes' bfloat16 as raw two-byte records ('<V2'): the floats' type is lost
    np.savez(path, **{WEIGHT: np.full((4, 4), 0.5, np.float32), ODD: np.full(8, 3.0 * odd, ml_dtypes.bfloat16)})
    return path


_SAVED: dict[tuple[str, int], bytes] = {}  # torch starts in 2 s: each file is written once


def _torch_save(folder: Path, dtype: str, odd: int = 1) -> Path:
    pytest.importorskip("torch")
    path = folder / "model.pt"
    if (dtype, odd) not in _SAVED:
        code = ("import sys, torch\n"
                f"odd = (torch.arange(1, 9, dtype=torch.uint8) * {odd}).view(torch.{dtype})\n"
                f"torch.save({{{WEIGHT!r}: torch.full((4, 4), 0.5), {ODD!r}: odd}}, sys.argv[1])\n")
        subprocess.run([sys.executable, "-c", code, str(path)], check=True)
        _SAVED[dtype, odd] = path.read_bytes()
    path.write_bytes(_SAVED[dtype, odd])
    return path


FILES: dict[str, Callable[..., Path]] = {
    "gguf-unknown-type": _gguf,
    "safetensors-F4": _safetensors_f4,
    "hdf5-quad-floats": _hdf5_quad,
    "hdf5-external-storage": _hdf5_external,
    "npz-raw-bfloat16": _npz_raw_bfloat16,
    "pt-float4": lambda folder, odd=1: _torch_save(folder, "float4_e2m1fn_x2", odd),
}
ODD_NAMES = {"gguf-unknown-type": "blk.0.ffn_down.weight"}

CLIPS = {"global": ["global", "--clip", "1"], "norm": ["norm", "--clip", "1"], "average": ["average", "--clip", "1"],
         "value": ["value", "--min", "-0.25", "--max", "0.25"], "norm-in-place": ["norm", "--clip", "1", "--in-place"],
         "global-dry-run": ["global", "--clip", "1", "--dry-run"]}


def _made(tmp_path: Path, kind: str) -> tuple[Path, bytes]:
    folder = tmp_path / "in"
    folder.mkdir()
    path = FILES[kind](folder)
    return path, path.read_bytes()


@pytest.mark.parametrize("command", sorted(CLIPS))
@pytest.mark.parametrize("kind", sorted(FILES))
def test_a_clip_refuses_a_selected_tensor_it_cannot_read(tmp_path, kind, command):
    path, before = _made(tmp_path, kind)
    result = run(*CLIPS[command], path)
    odd = ODD_NAMES.get(kind, ODD)
    assert result.exit_code == 1, result.output
    assert result.stderr.startswith(f"Error: {path}: ") and repr(odd) in result.stderr, result.stderr
    assert "--exclude" in result.stderr and "Traceback" not in result.output
    assert sorted(p.name for p in path.parent.iterdir()) == sorted(
        ["stored.bin", path.name] if kind == "hdf5-external-storage" else [path.name])  # nothing written
    assert path.read_bytes() == before


@pytest.mark.parametrize("kind", sorted(FILES))
def test_the_gate_says_what_it_did_not_measure_and_diff_what_it_compared_as_bytes(tmp_path, kind):
    path, _ = _made(tmp_path, kind)
    odd = ODD_NAMES.get(kind, ODD)
    gate = run("report", "--max-norm", "100", "-q", path)
    assert gate.exit_code == 3 and "not measured" in gate.stderr and odd in gate.stderr, gate.output
    # diff compares a type it cannot read byte for byte (the same bytes are the same values), or
    # says it did not compare it: never "same" over bytes that differ
    other = tmp_path / "other"
    other.mkdir()
    changed = FILES[kind](other, 2)
    diff = run("diff", "--json", path, changed)
    assert diff.exit_code == 3, diff.output
    data = json.loads(diff.stdout)
    differing = [t["name"] for t in data["tensors"] if t["differs"]]
    not_compared = [t["name"] for t in data["not_compared"]]
    assert (differing, not_compared) in (([odd], []), ([], [odd])), data


@pytest.mark.parametrize("kind", sorted(FILES))
def test_left_out_by_name_the_rest_is_clipped(tmp_path, kind):
    path, _ = _made(tmp_path, kind)
    out = tmp_path / f"out{path.suffix}"
    result = run("global", "--clip", "1", "--exclude", ODD_NAMES.get(kind, ODD), "-o", out, path)
    assert result.exit_code == 0, result.output
    assert out.exists()
    assert run("report", "--max-norm", "100", "--exclude", ODD_NAMES.get(kind, ODD), "-q", path).exit_code == 0


def test_a_type_known_to_hold_no_floats_is_carried(tmp_path):
    folder = tmp_path / "in"
    folder.mkdir()
    path = _torch_save(folder, "complex32")
    result = run("global", "--clip", "1", path)
    assert result.exit_code == 0, result.output
    assert "skipped (torch.complex32 (not supported) is not numeric)" in result.stdout
    assert run("report", "--max-norm", "100", "-q", path).exit_code == 3  # never measured: the gate says so


def test_a_set_refuses_a_shard_s_tensor_it_cannot_read(tmp_path):
    folder = tmp_path / "ck"
    folder.mkdir()
    good = np.full(4, 0.5, np.float32)
    _safetensors_f4(folder).rename(folder / "model-00001-of-00002.safetensors")
    np_header = json.dumps({"model.norm.weight": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}}).encode()
    np_header += b" " * (-len(np_header) % 8)
    (folder / "model-00002-of-00002.safetensors").write_bytes(len(np_header).to_bytes(8, "little") + np_header +
                                                              good.tobytes())
    index = folder / "model.safetensors.index.json"
    index.write_text(json.dumps({"metadata": {}, "weight_map": {
        ODD: "model-00001-of-00002.safetensors", WEIGHT: "model-00001-of-00002.safetensors",
        "model.norm.weight": "model-00002-of-00002.safetensors"}}))
    result = run("global", "--clip", "1", "--out-dir", tmp_path / "out", index)
    assert result.exit_code == 1, result.output
    assert repr(ODD) in result.stderr and "--exclude" in result.stderr
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())
