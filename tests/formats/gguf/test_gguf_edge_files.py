"""GGUF files at the edges: split files out of their set, tensors tclip cannot measure, 0-d
tensors, signalling-NaN block scales, and files cut after their header.

Files are written with the ``gguf`` package (llama.cpp's own Python writer) where it can
write them, and with :mod:`gguf_helpers` where it cannot (unknown types, raw Q6_K blocks).
"""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np
import pytest

from support import gguf_helpers as gh
from support.cli import run



def write(path: Path, tensors: dict[str, np.ndarray], keys: list[tuple[str, str, object]] = (),
          raw: dict[str, tuple[np.ndarray, int]] | None = None) -> Path:
    """A GGUF file by gguf-py: ``keys`` as (name, GGUFWriter method, value); ``raw``: blocks of a
    quantized type as (uint8 rows of blocks, ggml type)."""
    writer = gguf.GGUFWriter(str(path), "llama")
    for key, method, value in keys:
        getattr(writer, method)(key, value)
    for name, array in tensors.items():
        writer.add_tensor(name, array)
    for name, (blocks, kind) in (raw or {}).items():
        writer.add_tensor(name, blocks, raw_shape=blocks.shape, raw_dtype=gguf.GGMLQuantizationType(kind))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


# --------------------------------------------------------------------------- split files out of their set


def split_set(folder: Path) -> Path:
    """Two good splits and a third file named as split 0 whose split.no is -1 (NaN and 1e30 in it)."""
    rng = np.random.default_rng(3)
    for no in range(2):
        write(folder / f"m-{no + 1:05d}-of-00002.gguf",
              {f"blk.{no}.attn_q.weight": rng.standard_normal((4, 32)).astype(np.float32)},
              [("split.no", "add_uint16", no), ("split.count", "add_uint16", 2),
               ("split.tensors.count", "add_int32", 2)])
    bad = np.array([[np.nan, 1e30, 0, 0]], np.float32)
    return write(folder / "m-00000-of-00002.gguf", {"blk.0.attn_q.weight": bad},
                 [("split.no", "add_int32", -1), ("split.count", "add_uint16", 2),
                  ("split.tensors.count", "add_int32", 2)])


@pytest.mark.parametrize("command", [["report", "--max-norm", "100"], ["info"],
                                     ["global", "--clip", "1", "--out-dir", "x"]])
def test_a_split_file_outside_its_set_is_refused(tmp_path, command):
    bad = split_set(tmp_path)
    args = [*command[:-1], tmp_path / "out"] if command[-1] == "x" else command
    result = run(*args, bad)
    assert result.exit_code == 1, result.output
    errors = [line for line in result.stderr.splitlines() if line.startswith("Error:")]
    assert len(errors) == 1 and str(bad) in errors[0] and "split.no" in errors[0], result.stderr
    assert "Traceback" not in result.output


def test_a_glob_of_a_set_with_a_stray_file_is_not_taken_as_the_set(tmp_path):
    split_set(tmp_path)
    result = run("report", "--max-norm", "100", *sorted(tmp_path.glob("m-*.gguf")))
    assert result.exit_code != 0, result.output
    assert "m-00000-of-00002.gguf" in result.stderr and "split.no" in result.stderr


def test_a_split_number_beyond_the_count_is_refused(tmp_path):
    split_set(tmp_path)
    stray = write(tmp_path / "m-00003-of-00002.gguf", {"blk.2.attn_q.weight": np.ones((1, 4), np.float32)},
                  [("split.no", "add_uint16", 2), ("split.count", "add_uint16", 2)])
    result = run("report", stray)
    assert result.exit_code == 1, result.output
    assert str(stray) in result.stderr and "split.no" in result.stderr


@pytest.mark.parametrize("no, count", [(4, 1), (0, 0), (-1, 1)])
def test_split_keys_out_of_range_in_a_file_of_its_own_are_refused(tmp_path, no, count):
    path = write(tmp_path / "model.gguf", {"blk.0.attn_q.weight": np.ones((1, 4), np.float32)},
                 [("split.no", "add_int32", no), ("split.count", "add_int32", count)])
    for command in (["report"], ["info"]):
        result = run(*command, path)
        assert result.exit_code == 1, result.output
        assert result.stderr.startswith(f"Error: {path}: ") and "split.no" in result.stderr


def test_the_set_itself_is_still_read(tmp_path):
    split_set(tmp_path)
    result = run("report", "--json", tmp_path / "m-00002-of-00002.gguf")
    assert result.exit_code == 0, result.stderr
    assert len(json.loads(result.stdout)["tensors"]) == 2


# --------------------------------------------------------------------------- tensors that are not measured


def test_a_tensor_of_an_unknown_type_is_counted_as_skipped(tmp_path):
    path = gh.write_gguf(tmp_path / "unknown.gguf", gh.GgufSpec(tensors=[
        gh.Tensor("blk.0.attn_q.weight", (4, 32), 99, bytes(64))]))
    result = run("report", path)
    assert result.exit_code == 0, result.output
    assert "0 skipped" not in result.stdout and "1 skipped" in result.stdout
    assert "blk.0.attn_q.weight" in result.stdout and "1 not measured" in result.stdout
    data = json.loads(run("report", "--json", path).stdout)
    assert data["tensors_skipped"] == 1 and data["tensors_not_measured"] == 1
    gate = run("report", "--max-norm", "100", path)
    assert gate.exit_code == 3 and "not measured" in gate.stderr  # the gate never passed over it
    excluded = json.loads(run("report", "--json", "--exclude", "blk.0.*", path).stdout)
    assert excluded["tensors_skipped"] == 0 and excluded["tensors_not_measured"] == 0


def test_the_summary_says_what_part_of_the_file_its_global_norm_covers(tmp_path):
    rng = np.random.default_rng(5)
    tensors = [gh.Tensor(f"blk.{i}.attn_norm.weight", (256,), 0, rng.standard_normal(256).astype("<f4").tobytes())
               for i in range(5)]
    for i in range(8):
        tensors.append(gh.Tensor(f"blk.{i}.ffn_up.weight", (2, 256), 39, bytes(2 * 256 // 32 * 17)))  # MXFP4
        tensors.append(gh.Tensor(f"blk.{i}.ffn_down.weight", (2, 256), 35, bytes(2 * 66)))  # TQ2_0
    path = gh.write_gguf(tmp_path / "mixed.gguf", gh.GgufSpec(tensors=tensors))
    result = run("report", path)
    assert result.exit_code == 0, result.output
    summary = next(line for line in result.stdout.splitlines() if line.startswith("global norm"))
    assert "5 of 21 tensors" in summary and "16 not measured" in summary and "16 skipped" in summary
    data = json.loads(run("report", "--json", path).stdout)
    assert data["tensors_not_measured"] == 16 and data["tensors_skipped"] == 16
    assert run("report", "--max-norm", "1000", path).exit_code == 3
    batch = run("report", path, path.with_name("mixed.gguf"))  # every file's line says it too
    assert batch.stdout.count("16 not measured") == 2
    other = tmp_path / "other.gguf"
    other.write_bytes(path.read_bytes())
    summary = run("report", "--summary", path, other)  # one row per file: each says it
    assert summary.exit_code == 0, summary.output
    rows = [line for line in summary.stdout.splitlines() if line.startswith(("mixed", "other"))]
    assert len(rows) == 2 and all(row.rstrip().endswith("16 of 21") for row in rows), summary.stdout
    objects = [json.loads(line) for line in run("report", "--summary", "--json", path, other).stdout.splitlines()]
    assert [o["tensors_not_measured"] for o in objects] == [16, 16]


# --------------------------------------------------------------------------- 0-d tensors and empty weights


def test_a_zero_dimensional_tensor_is_a_tensor(tmp_path):
    path = write(tmp_path / "scalar.gguf", {"s": np.array(5.0, np.float32),
                                            "blk.0.attn_norm.weight": np.full(8, 1.0, np.float32)})
    info = run("info", "--json", path)
    assert info.exit_code == 0, info.output
    shapes = {t["name"]: t["shape"] for t in json.loads(info.stdout)["tensors"]}
    assert shapes == {"s": [], "blk.0.attn_norm.weight": [8]}
    report = run("report", "--json", path)
    assert report.exit_code == 0, report.output
    norms = {t["name"]: t["norm"] for t in json.loads(report.stdout)["tensors"]}
    assert norms["s"] == 5.0
    out = tmp_path / "out.gguf"
    clipped = run("global", "--clip", "1", "-o", out, path)
    assert clipped.exit_code == 0, clipped.output
    values = {t.name: np.array(t.data) for t in gguf.GGUFReader(str(out)).tensors}
    factor = 1 / np.sqrt(25 + 8)
    assert float(values["s"].reshape(-1)[0]) == pytest.approx(5 * factor, rel=1e-6)


# --------------------------------------------------------------------------- signalling NaN scales


def q6_k_with_signalling_nan(path: Path) -> Path:
    rng = np.random.default_rng(0)
    blocks = np.frombuffer(gh.random_blocks(14, 4, rng, d=2e-5), np.uint8).reshape(2, 420).copy()
    blocks.reshape(-1, 210)[0, 208:210] = np.array([0x7C01], "<u2").view(np.uint8)  # d: a signalling NaN
    return write(path, {}, raw={"blk.0.ffn_down.weight": (blocks, 14)})


@pytest.mark.parametrize("command", [["report"], ["report", "--stats"], ["report", "--axes", "1"],
                                     ["report", "--json"], ["info"]])
def test_no_numpy_warning_leaks_from_a_signalling_nan_scale(tmp_path, command):
    path = q6_k_with_signalling_nan(tmp_path / "q6.gguf")
    result = run(*command, path)
    assert result.exit_code == 0, result.output
    assert "encountered" not in result.stderr and "RuntimeWarning" not in result.stderr, result.stderr
    for line in result.stderr.splitlines():
        assert line.startswith(f"Warning: {path}: "), line
    if command == ["report", "--json"]:
        assert json.loads(result.stdout)["tensors"][0]["nonfinite"]["nan"] == 256  # the NaN block's values, as ever


def test_no_numpy_warning_leaks_from_diff_or_a_clip(tmp_path):
    path = q6_k_with_signalling_nan(tmp_path / "q6.gguf")
    for args in (["diff", path, path], ["global", "--clip", "1", "-o", tmp_path / "o.gguf", path],
                 ["norm", "--clip", "1", "--axes", "1", "--nonfinite", "propagate", "-o", tmp_path / "p.gguf", path]):
        result = run(*args)
        assert "encountered" not in result.stderr, (args, result.stderr)


# --------------------------------------------------------------------------- files cut after the header


def cut_after_header(folder: Path) -> Path:
    """A GGUF file whose tensor data is missing: it ends where the tensor infos end."""
    rng = np.random.default_rng(1)
    path = write(folder / "whole.gguf", {"blk.0.attn_q.weight": rng.standard_normal((4, 32)).astype(np.float32),
                                         "blk.0.attn_k.weight": rng.standard_normal((4, 32)).astype(np.float32)})
    reader = gguf.GGUFReader(str(path))
    start = min(int(t.data_offset) for t in reader.tensors)
    del reader
    cut = folder / "cut.gguf"
    cut.write_bytes(path.read_bytes()[:start])
    return cut


def test_info_lists_a_file_whose_data_is_missing_and_says_so(tmp_path):
    cut = cut_after_header(tmp_path)
    result = run("info", cut)
    assert result.exit_code == 0, result.output
    assert "blk.0.attn_q.weight" in result.stdout and "blk.0.attn_k.weight" in result.stdout
    assert "truncated" in result.stderr and result.stderr.startswith(f"Warning: {cut}: ")
    data = json.loads(run("info", "--json", cut).stdout)
    assert [t["shape"] for t in data["tensors"]] == [[4, 32], [4, 32]]
    assert any("truncated" in w for w in data["warnings"])


@pytest.mark.parametrize("command", [["report"], ["report", "--max-norm", "10"], ["global", "--clip", "1"],
                                     ["norm", "--clip", "1", "--exclude", "blk.0.attn_k.weight"]])
def test_report_and_clip_refuse_a_file_whose_data_is_missing(tmp_path, command):
    cut = cut_after_header(tmp_path)
    out = tmp_path / "out.gguf"
    args = [*command, "-o", out] if command[0] != "report" else command
    result = run(*args, cut)
    assert result.exit_code == 1, result.output
    errors = [line for line in result.stderr.splitlines() if line.startswith("Error:")]
    assert len(errors) == 1 and errors[0].startswith(f"Error: {cut}: ") and "truncated" in errors[0]
    assert not out.exists()
