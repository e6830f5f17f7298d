"""The command line, through click's CliRunner: every command, option and exit code."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import h5py
import ml_dtypes
import numpy as np
import pytest
from safetensors.numpy import load_file

from support.cli import run
from support.formats_helpers import read_all, safetensors_bytes
import tclip
from tclip.formats import open_reader


@pytest.fixture
def npz(tmp_path) -> Path:
    rng = np.random.default_rng(3)
    path = tmp_path / "grads.npz"
    np.savez(path, **{
        "fc1.weight": (rng.standard_normal((8, 4)) * 10).astype(np.float32),
        "fc1.bias": rng.standard_normal(8).astype(np.float32),
        "step": np.array(5, np.int64),
    })
    return path


@pytest.fixture
def st(tmp_path) -> Path:
    rng = np.random.default_rng(4)
    path = tmp_path / "grads.safetensors"
    path.write_bytes(safetensors_bytes({
        "attn.q": (rng.standard_normal((4, 4)) * 3).astype(ml_dtypes.bfloat16),
        "mlp.w": (rng.standard_normal((4, 6)) * 3).astype(np.float32),
        "step": np.array(41200, np.int64),
    }, metadata={"step": "41200"}))
    return path


def strict_json(line: str):
    def refuse(name):
        raise ValueError(f"non-standard JSON constant {name}")
    return json.loads(line, parse_constant=refuse)


# ------------------------------------------------------------------ help and version


@pytest.mark.parametrize("command", ["value", "norm", "average", "global", "report", "info"])
def test_every_command_has_help_with_an_example(command):
    result = run(command, "--help")
    assert result.exit_code == 0, result.output
    assert "Example:" in result.output


def test_version_and_python_m():
    assert run("--version").output.strip() == f"tclip, version {tclip.__version__}"
    out = subprocess.run([sys.executable, "-m", "tclip", "--version"], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == f"tclip, version {tclip.__version__}"


# ------------------------------------------------------------------ clipping commands


def test_norm_with_axes_on_mixed_ranks(npz):
    result = run("norm", "--clip", "5", "--axes", "1", npz)
    assert result.exit_code == 0, result.output + result.stderr
    out = npz.with_name("grads.clipped.npz")
    with np.load(npz) as before, np.load(out) as after:
        assert list(after.keys()) == ["fc1.weight", "fc1.bias", "step"]
        np.testing.assert_array_equal(after["fc1.weight"], tclip.clip_by_norm(before["fc1.weight"], 5, axes=1))
        np.testing.assert_array_equal(after["fc1.bias"], before["fc1.bias"])
        assert after["step"] == 5 and after["step"].dtype == np.int64
    assert "Warning: " in result.stderr and "fc1.bias (rank 1 has no axis 1)" in result.stderr
    assert "grads.clipped.npz" in result.stdout and "fc1.weight" in result.stdout


def test_strict_axes_is_an_error_and_writes_nothing(npz):
    result = run("norm", "--clip", "5", "--axes", "1", "--strict", npz)
    assert result.exit_code == 1
    assert result.stderr.strip() == (f"Error: {npz}: --axes does not fit 1 tensor(s): "
                                     "fc1.bias (rank 1 has no axis 1)")
    assert sorted(os.listdir(npz.parent)) == ["grads.npz"]


def test_global_on_safetensors_keeps_dtypes_and_metadata(st):
    result = run("global", "--clip", "1", st)
    assert result.exit_code == 0, result.stderr
    out = st.with_name("grads.clipped.safetensors")
    got = read_all(out)
    assert got["attn.q"].dtype == ml_dtypes.bfloat16 and got["step"] == 41200
    norm = tclip.global_norm([got["attn.q"], got["mlp.w"]])
    assert norm <= 1.0 * (1 + 2**-7)
    with open_reader(out) as reader:
        assert reader.metadata == {"step": "41200"}


def test_global_norm_covers_selected_tensors_only(st):
    result = run("global", "--clip", "1", "--include", "mlp.*", "--json", st)
    assert result.exit_code == 0, result.stderr
    data = strict_json(result.stdout)
    before = read_all(st)
    assert data["global_norm"] == pytest.approx(tclip.global_norm([before["mlp.w"]]), rel=1e-12)
    after = read_all(st.with_name("grads.clipped.safetensors"))
    np.testing.assert_array_equal(after["attn.q"], before["attn.q"])
    skipped = {t["name"]: (t["selected"], t["skipped"]) for t in data["tensors"]}
    # Unselected tensors stay listed, marked, and are not "skipped" (issue 20.12).
    assert skipped == {"attn.q": (False, None), "mlp.w": (True, None), "step": (False, None)}
    assert (data["tensors_skipped"], data["tensors_not_selected"]) == (0, 2)


def test_value_on_hdf5_keeps_attributes(tmp_path):
    path = tmp_path / "g.h5"
    with h5py.File(path, "w") as f:
        f.attrs["step"] = 9
        d = f.create_dataset("enc/w", data=np.linspace(-3, 3, 12).reshape(3, 4), compression="gzip", chunks=(1, 4))
        d.attrs["kind"] = "grad"
    result = run("value", "--min", "-1", "--max", "1", "--json", path)
    assert result.exit_code == 0, result.stderr
    data = strict_json(result.stdout)
    assert data["tensors"][0]["changed"] == 8
    with h5py.File(tmp_path / "g.clipped.h5", "r") as f:
        assert f.attrs["step"] == 9 and f["enc/w"].attrs["kind"] == "grad" and f["enc/w"].compression == "gzip"
        np.testing.assert_array_equal(f["enc/w"][()], np.clip(np.linspace(-3, 3, 12).reshape(3, 4), -1, 1))


def test_average_on_npy(tmp_path):
    path = tmp_path / "g.npy"
    t = np.full((10, 10), 3.0, np.float32)  # norm 30, average 0.3
    np.save(path, t)
    result = run("average", "--clip", "0.1", path)
    assert result.exit_code == 0, result.stderr
    np.testing.assert_allclose(np.load(tmp_path / "g.clipped.npy"), tclip.clip_by_average_norm(t, 0.1))


def test_output_conversion_and_out_dir(npz, tmp_path):
    result = run("norm", "--clip", "1", "-o", tmp_path / "x.safetensors", npz)
    assert result.exit_code == 0, result.stderr
    assert set(load_file(str(tmp_path / "x.safetensors"))) == {"fc1.weight", "fc1.bias", "step"}
    (tmp_path / "out").mkdir()
    result = run("norm", "--clip", "1", "--out-dir", tmp_path / "out", npz)
    assert result.exit_code == 0, result.stderr
    assert (tmp_path / "out" / "grads.npz").exists()


def test_existing_output_needs_force_and_in_place_replaces(npz):
    assert run("norm", "--clip", "1", npz).exit_code == 0
    again = run("norm", "--clip", "1", npz)
    assert again.exit_code == 1
    assert again.stderr.strip() == f"Error: {npz.with_name('grads.clipped.npz')}: output already exists; pass --force to replace it"
    assert run("norm", "--clip", "1", "--force", npz).exit_code == 0
    original = npz.read_bytes()
    assert run("norm", "--clip", "1", "--in-place", npz).exit_code == 0
    assert npz.read_bytes() != original
    assert sorted(os.listdir(npz.parent)) == ["grads.clipped.npz", "grads.npz"]


def test_dry_run_writes_nothing(npz):
    result = run("norm", "--clip", "1", "--dry-run", "--json", npz)
    assert result.exit_code == 0
    data = strict_json(result.stdout)
    assert data["output"] is None and data["dry_run"] is True
    assert data["global_norm_after"] == pytest.approx(math.sqrt(2), rel=1e-6)
    assert sorted(os.listdir(npz.parent)) == ["grads.npz"]


def test_nonfinite_is_refused_by_default_and_propagates_on_request(tmp_path):
    path = tmp_path / "nan.npz"
    np.savez(path, ok=np.ones(3, np.float32), bad=np.array([1.0, np.nan, np.inf], np.float32))
    result = run("global", "--clip", "1", path)
    assert result.exit_code == 1
    assert result.stderr.strip() == (f"Error: {path}: NaN/Inf values in bad (1 NaN, 1 Inf); nothing was written "
                                     "(--nonfinite propagate clips them as TensorFlow does)")
    assert sorted(os.listdir(tmp_path)) == ["nan.npz"]
    result = run("global", "--clip", "1", "--nonfinite", "propagate", "--json", path)
    assert result.exit_code == 0
    data = strict_json(result.stdout)
    assert data["global_norm"] == "nan"
    with np.load(tmp_path / "nan.clipped.npz") as z:
        assert np.isnan(z["ok"]).all()


def test_json_lines_one_object_per_file(npz, st):
    result = run("report", "--json", npz, st)
    assert result.exit_code == 0
    lines = result.stdout.strip().splitlines()
    assert len(lines) == 2
    objects = [strict_json(line) for line in lines]
    for obj in objects:
        assert {"schema", "file", "output", "mode", "params", "global_norm", "global_norm_after", "tensors",
                "elapsed_s"} <= obj.keys()
        for t in obj["tensors"]:
            assert {"name", "shape", "dtype", "norm", "norm_after", "scale", "clipped", "skipped",
                    "nonfinite"} <= t.keys()


# ------------------------------------------------------------------ bad arguments and bad files


@pytest.mark.parametrize("args,message", [
    (["norm", "--clip", "0"], "Invalid value for '--clip': must be > 0, got 0"),
    (["norm", "--clip", "-2"], "must be > 0"),
    (["norm", "--clip", "nan"], "NaN is not allowed"),
    (["norm", "--clip", "abc"], "'abc' is not a number"),
    (["norm", "--clip", "1", "--axes", "a"], "is not a comma-separated list of integers"),
    (["norm", "--clip", "1", "--axes", "1,1"], "repeats an axis"),
    (["value", "--min", "2", "--max", "1"], "--min 2 is greater than --max 1"),
    (["value", "--min", "0"], "Missing option '--max'"),
    (["global", "--clip", "1", "--nonfinite", "ignore"], "Invalid value for '--nonfinite'"),
    (["norm", "--clip", "1", "-o", "x.txt"], "the suffix must be .npy, .npz, .safetensors, .h5, .hdf5, .pt, .pth, .bin or .gguf"),
])
def test_bad_arguments_exit_2_before_reading(tmp_path, args, message):
    result = run(*args, tmp_path / "missing.npz")
    assert result.exit_code == 2, result.output
    assert message in result.stderr


def test_output_with_two_inputs_is_a_usage_error(npz, st, tmp_path):
    result = run("norm", "--clip", "1", "-o", tmp_path / "x.npz", npz, st)
    assert result.exit_code == 2
    assert "-o/--output takes exactly one input file" in result.stderr


def test_bad_file_is_one_error_line_and_the_rest_still_run(npz, tmp_path):
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json at all")
    result = run("norm", "--clip", "1", bad, npz)
    assert result.exit_code == 1
    errors = [line for line in result.stderr.splitlines() if line.startswith("Error:")]
    assert errors == [f"Error: {bad}: header is not valid JSON (Expecting property name enclosed in double "
                      "quotes: line 1 column 2 (char 1))"]
    assert "Traceback" not in result.output + result.stderr
    assert (tmp_path / "grads.clipped.npz").exists()
    assert not (tmp_path / "bad.clipped.safetensors").exists()
    assert "2 files: 1 ok, 1 failed" in result.stdout


def test_fail_fast_stops_at_first_failure(npz, tmp_path):
    missing = tmp_path / "missing.npz"
    result = run("norm", "--clip", "1", "--fail-fast", missing, npz)
    assert result.exit_code == 1
    assert result.stderr.strip() == f"Error: {missing}: no such file"
    assert not (tmp_path / "grads.clipped.npz").exists()


def test_globs_directories_and_recursion(tmp_path):
    (tmp_path / "run" / "deep").mkdir(parents=True)
    for name in ("run/a.npy", "run/b.npy", "run/deep/c.npy"):
        np.save(tmp_path / name, np.ones(4, np.float32))
    (tmp_path / "run" / "notes.txt").write_text("not a tensor")
    result = run("report", "--json", tmp_path / "run")
    assert [strict_json(x)["file"] for x in result.stdout.splitlines()] == [
        str(tmp_path / "run/a.npy"), str(tmp_path / "run/b.npy")]
    result = run("report", "--json", "-r", tmp_path / "run")
    assert len(result.stdout.splitlines()) == 3
    result = run("norm", "--clip", "1", "--json", str(tmp_path / "run" / "*.npy"))
    assert result.exit_code == 0 and len(result.stdout.splitlines()) == 2
    # outputs of an earlier run are not taken as inputs
    result = run("report", "--json", str(tmp_path / "run" / "*.npy"))
    assert len(result.stdout.splitlines()) == 2
    result = run("report", str(tmp_path / "run" / "*.npz"))
    assert result.exit_code == 1 and "no tensor files match" in result.stderr


# ------------------------------------------------------------------ report and info


def test_report_max_norm_gates_with_exit_3(npz):
    assert run("report", "--max-norm", "1e6", npz).exit_code == 0
    result = run("report", "--max-norm", "1", npz)
    assert result.exit_code == 3
    assert "check failed: global norm" in result.stderr
    assert run("report", "--max-norm", "1e6", "--axes", "1", npz).exit_code == 0
    assert run("report", "--max-norm", "1", "--axes", "1", npz).exit_code == 3


def test_report_nonfinite_fails_the_check(tmp_path):
    path = tmp_path / "nan.npy"
    np.save(path, np.array([1.0, np.nan]))
    result = run("report", "--max-norm", "100", path)
    assert result.exit_code == 3
    assert "NaN/Inf in nan" in result.stderr


def test_report_orders(npz):
    data = {o: strict_json(run("report", "--json", "--ord", o, npz).stdout) for o in ("1", "2", "inf")}
    with np.load(npz) as z:
        w = z["fc1.weight"].astype(np.float64)
    by_name = {o: {t["name"]: t["norm"] for t in d["tensors"]} for o, d in data.items()}
    assert by_name["1"]["fc1.weight"] == pytest.approx(np.abs(w).sum(), rel=1e-12)
    assert by_name["2"]["fc1.weight"] == pytest.approx(np.sqrt((w * w).sum()), rel=1e-12)
    assert by_name["inf"]["fc1.weight"] == np.abs(w).max()
    assert by_name["2"]["step"] is None


def test_info_reads_no_tensor_data(st, monkeypatch):
    from tclip.formats.safetensors import SafetensorsReader

    def refuse(*args, **kwargs):
        raise AssertionError("info read tensor data")

    monkeypatch.setattr(SafetensorsReader, "read", refuse)
    result = run("info", "--json", st)
    assert result.exit_code == 0, result.stderr
    data = strict_json(result.stdout)
    assert data["metadata"] == {"step": "41200"}
    assert data["params_by_dtype"] == {"int64": 1, "float32": 24, "bfloat16": 16}
    text = run("info", st).stdout
    assert "bfloat16" in text and "41200" in text and "41 tensors" not in text


def test_quiet_prints_nothing_on_success(npz):
    result = run("norm", "--clip", "1", "--axes", "1", "-q", npz)
    assert result.exit_code == 0
    assert result.stdout == "" and result.stderr == ""


def test_value_accepts_one_sided_infinite_bounds(tmp_path):
    path = tmp_path / "g.npy"
    np.save(path, np.array([-5.0, 0.5, 5.0], np.float32))
    result = run("value", "--min", "-inf", "--max", "1", path)
    assert result.exit_code == 0, result.stderr
    np.testing.assert_array_equal(np.load(tmp_path / "g.clipped.npy"), [-5.0, 0.5, 1.0])


def test_in_place_on_a_file_known_by_its_content(tmp_path):
    path = tmp_path / "step_41200"  # no suffix: recognised as safetensors by its header
    path.write_bytes(safetensors_bytes({"w": np.full(4, 3.0, np.float32)}))
    result = run("norm", "--clip", "1", "--in-place", path)
    assert result.exit_code == 0, result.stderr
    np.testing.assert_allclose(read_all(path)["w"], np.full(4, 0.5), rtol=1e-7)
    assert sorted(os.listdir(tmp_path)) == ["step_41200"]


def test_big_endian_npy_is_clipped_in_its_own_byte_order(tmp_path):
    path = tmp_path / "be.npy"
    np.save(path, np.array([[3.0, 4.0], [0.3, 0.4]], ">f4"))
    assert run("norm", "--clip", "1", "--axes", "1", path).exit_code == 0
    out = np.load(tmp_path / "be.clipped.npy")
    assert out.dtype == np.dtype(">f4")
    np.testing.assert_allclose(out, [[0.6, 0.8], [0.3, 0.4]], rtol=1e-7)
