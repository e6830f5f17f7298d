"""Issue 20 (1, 2, 11) and 21.10: a ``report --max-norm`` gate never passes over what it did not
measure, fails on every tensor over the limit whatever its rank, and says so in a bounded line."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import h5py
import numpy as np
import pytest

from support.cli import run80 as run
from support.formats_helpers import safetensors_bytes


LAYERS = 32


def llama(path: Path, layers: int = LAYERS, norm_value: float = 1.0) -> Path:
    """Layer norms (rank 1, norm 8 each at the default value) beside small 2-D projections."""
    tensors = {}
    for i in range(layers):
        tensors[f"model.layers.{i}.input_layernorm.weight"] = np.full(64, norm_value, np.float32)
        tensors[f"model.layers.{i}.self_attn.k_proj.weight"] = np.full((8, 8), 0.01, np.float32)
    path.write_bytes(safetensors_bytes(tensors))
    return path


# ------------------------------------------------------------------ 21.10 extreme limits


def test_a_subnormal_limit_is_a_failed_check_not_an_internal_error(tmp_path):
    source = llama(tmp_path / "m.safetensors", layers=2)
    for extra in ([], ["--axes", "1"]):
        result = run("report", "--max-norm", "1e-320", *extra, source)
        assert result.exit_code == 3, result.output
        assert "internal error" not in result.output
        assert "check failed" in result.stderr


# ------------------------------------------------------------------ 20.1 ranks that cannot take the axes


def test_tensors_that_cannot_take_the_axes_are_gated_on_their_whole_norm(tmp_path):
    source = llama(tmp_path / "m.safetensors")  # 32 layernorms of norm 8, rows of norm 0.08
    result = run("report", "--axes", "1", "--max-norm", "1", source)
    assert result.exit_code == 3, result.output
    line = result.stderr.strip()
    assert line.count("\n") == 0 and len(line) < 400, line
    assert ("norms above 1 in 32 tensors (largest first): model.layers.0.input_layernorm.weight (whole tensor, 8), "
            "model.layers.1.input_layernorm.weight (whole tensor, 8), model.layers.2.input_layernorm.weight "
            "(whole tensor, 8) and 29 more") in line
    assert run("report", "--axes", "1", "--max-norm", "8", "-q", source).exit_code == 0
    assert run("report", "--axes", "1", "--max-norm", "7.9", "-q", source).exit_code == 3
    assert run("report", "--axes", "1", "--max-norm", "1", "--exclude", "*layernorm*", "-q", source).exit_code == 0


def test_one_tensor_over_is_named_with_its_reason(tmp_path):
    source = llama(tmp_path / "m.safetensors", layers=1)
    result = run("report", "--axes", "1", "--max-norm", "1", "-q", source)
    assert result.exit_code == 3
    assert ("check failed: whole-tensor norm 8 above 1 in model.layers.0.input_layernorm.weight (its rank cannot "
            "take the axes)") in result.stderr


def test_rows_and_whole_tensors_largest_first(tmp_path):
    source = tmp_path / "m.safetensors"
    down = np.zeros((4, 16), np.float32)
    down[2] = 5.0  # row 2: norm 20
    source.write_bytes(safetensors_bytes({"model.layers.0.mlp.down_proj.weight": down,
                                         "model.norm.weight": np.full(64, 1.0, np.float32)}))
    result = run("report", "--axes", "1", "--max-norm", "1", "-q", source)
    assert result.exit_code == 3
    assert ("norms above 1 in 2 tensors (largest first): model.layers.0.mlp.down_proj.weight row 2 (20), "
            "model.norm.weight (whole tensor, 8)") in result.stderr


# ------------------------------------------------------------------ 20.2 what could not be measured


def hdf5_with(path: Path, **extra) -> Path:
    with h5py.File(path, "w") as f:
        for i in range(4):
            f.create_dataset(f"model/layers.{i}/kernel", data=np.full((4, 4), 0.1, np.float32))
        f.create_dataset("vocab", data=np.array([b"<pad>", b"the"]))  # strings: not numbers, nothing to gate
        for name, make in extra.items():
            make(f, name)
    return path


def test_the_gate_passes_over_strings_but_not_over_what_it_could_not_read(tmp_path, monkeypatch):
    plain = hdf5_with(tmp_path / "plain.h5")
    assert run("report", "--max-norm", "100", "-q", plain).exit_code == 0
    monkeypatch.chdir(tmp_path)
    (tmp_path / "stored.bin").write_bytes(np.full(64, 1e6, np.float32).tobytes())
    external = hdf5_with(tmp_path / "external.h5", **{"model/lm_head": lambda f, n: f.create_dataset(
        n, shape=(64,), dtype="f4", external=[("stored.bin", 0, 256)])})
    result = run("report", "--max-norm", "100", external)
    assert result.exit_code == 3, result.output
    line = result.stderr.strip()
    assert line.startswith(f"Warning: {external}: check failed: 1 selected tensor not measured: model/lm_head "
                           "(external storage: its data lives in other files ('stored.bin')")
    data = json.loads(run("report", "--max-norm", "100", "--json", external).stdout)
    assert any(w.startswith("check failed: 1 selected tensor not measured: model/lm_head") for w in data["warnings"])
    assert run("report", "--max-norm", "100", "--exclude", "model/lm_head", "-q", external).exit_code == 0
    assert run("report", "-q", external).exit_code == 0  # no gate asked for: a report, exit 0


def test_an_unreadable_dtype_fails_the_gate(tmp_path):
    quad = hdf5_with(tmp_path / "quad.h5", extended=lambda f, n: f.create_dataset(n, data=np.arange(3.0,
                                                                                                       dtype=np.longdouble)))
    result = run("report", "--max-norm", "100", "-q", quad)
    assert result.exit_code == 3
    assert "1 selected tensor not measured: extended (128-bit floats (quad precision) are not supported)" \
        in result.stderr
    assert run("report", "--max-norm", "100", "--include", "model/*", "-q", quad).exit_code == 0
    f4 = tmp_path / "f4.safetensors"
    header = json.dumps({"model.embed_tokens.weight": {"dtype": "F4", "shape": [4], "data_offsets": [0, 2]},
                         "model.norm.weight": {"dtype": "F32", "shape": [2], "data_offsets": [2, 10]}}).encode()
    header += b" " * (-len(header) % 8)
    f4.write_bytes(len(header).to_bytes(8, "little") + header + b"\x12\x34" + np.array([3, 4], np.float32).tobytes())
    result = run("report", "--max-norm", "100", "-q", f4)
    assert result.exit_code == 3
    assert "1 selected tensor not measured: model.embed_tokens.weight (F4 [4] (not supported) is not numeric)" \
        in result.stderr


@pytest.mark.slow  # a child interpreter without hdf5plugin, 12 s
def test_a_missing_hdf5_filter_fails_the_gate(tmp_path):
    hdf5plugin = pytest.importorskip("hdf5plugin")
    path = tmp_path / "blosc.h5"
    with h5py.File(path, "w") as f:
        for i in range(5):
            f.create_dataset(f"model.layers.{i}.mlp.up_proj.weight", data=np.full((16, 64), 0.01, np.float32),
                             chunks=(16, 64), **hdf5plugin.Blosc())
        f.create_dataset("model.norm.weight", data=np.full(64, 0.01, np.float32))
    code = ("import sys; sys.modules['hdf5plugin'] = None\n"
            f"sys.argv = ['tclip', 'report', '--max-norm', '100', '-q', {str(path)!r}]\n"
            "from tclip.cli.entry import main\nmain()")
    env = {k: v for k, v in os.environ.items() if k != "HDF5_PLUGIN_PATH"}
    env["TCLIP_HDF5_PROBE"] = "0"
    missing = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert missing.returncode == 3, missing.stderr
    lines = missing.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].count("compressed with blosc") == 1  # the reason once
    assert ("check failed: 5 selected tensors not measured: model.layers.0.mlp.up_proj.weight, "
            "model.layers.1.mlp.up_proj.weight, model.layers.2.mlp.up_proj.weight and 2 more (compressed with blosc"
            ) in lines[0]
    assert run("report", "--max-norm", "100", "-q", path).exit_code == 0  # with the plugin: measured, passes


# ------------------------------------------------------------------ 20.11 bounded lines


def test_nan_in_51_tensors_is_one_short_line_worst_first(tmp_path):
    tensors = {}
    for i in range(51):
        values = np.ones(64, np.float32)
        values[: 1 + (i == 17) * 9] = np.nan  # layer 17 has 10 NaN, the others 1
        tensors[f"model.layers.{i}.post_attention_layernorm.weight"] = values
    source = tmp_path / "m.safetensors"
    source.write_bytes(safetensors_bytes(tensors))
    result = run("report", "--max-norm", "100", "-q", source)
    assert result.exit_code == 3
    line = result.stderr.strip()
    assert line.count("\n") == 0 and len(line) < 400, line
    assert ("NaN/Inf in model.layers.17.post_attention_layernorm.weight (10 NaN), "
            "model.layers.0.post_attention_layernorm.weight (1 NaN), "
            "model.layers.1.post_attention_layernorm.weight (1 NaN) and 48 more") in line


def test_a_sharded_set_gate_names_the_unmeasured_tensor(tmp_path):
    folder = tmp_path / "ck"
    folder.mkdir()
    (folder / "model-00001-of-00002.safetensors").write_bytes(safetensors_bytes(
        {"model.layers.0.mlp.up_proj.weight": np.full((4, 4), 0.1, np.float32)}))
    header = json.dumps({"lm_head.weight": {"dtype": "F4", "shape": [4], "data_offsets": [0, 2]}}).encode()
    header += b" " * (-len(header) % 8)
    (folder / "model-00002-of-00002.safetensors").write_bytes(len(header).to_bytes(8, "little") + header + b"\x12\x34")
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": {
        "model.layers.0.mlp.up_proj.weight": "model-00001-of-00002.safetensors",
        "lm_head.weight": "model-00002-of-00002.safetensors"}}))
    result = run("report", "--max-norm", "100", "-q", folder / "model.safetensors.index.json")
    assert result.exit_code == 3, result.output
    assert "1 selected tensor not measured: lm_head.weight (F4 [4] (not supported) is not numeric)" in result.stderr
