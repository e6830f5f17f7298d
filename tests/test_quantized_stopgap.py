"""Quantized weights (codes plus scale tensors) are never clipped as plain values (issue 16's stopgap)."""

from __future__ import annotations

import json
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
from click.testing import CliRunner
from formats_helpers import read_all, safetensors_bytes

from tclip.cli import cli
from tclip.work.quantized import quantized_members, scale_companions

RNG = np.random.default_rng(16)
W = "model.layers.17.self_attn.k_proj.weight"


def run(*args):
    return CliRunner().invoke(cli, [str(a) for a in args])


def deepseek_fp8() -> dict[str, np.ndarray]:
    """A DeepSeek-style FP8 layer: E4M3 codes, one float32 scale per 128x128 block, and a plain norm weight."""
    codes = (RNG.standard_normal((256, 256)) * 100).clip(-448, 448).astype(ml_dtypes.float8_e4m3fn)
    return {W: codes, W + "_scale_inv": np.array([[0.01, 0.02], [0.03, 0.04]], np.float32),
            "model.norm.weight": RNG.standard_normal(256).astype(np.float32)}


def nvfp4() -> dict[str, np.ndarray]:
    """A ModelOpt NVFP4 layer: packed e2m1 codes, float8 group scales, a float32 global scale, an activation scale."""
    return {W: RNG.integers(0, 256, (64, 32), dtype=np.uint8),
            W + "_scale": RNG.random((64, 4)).astype(ml_dtypes.float8_e4m3fn),
            W + "_scale_2": np.array(0.002, np.float32),
            "model.layers.17.self_attn.k_proj.input_scale": np.array(0.5, np.float32),
            "model.norm.weight": RNG.standard_normal(64).astype(np.float32)}


def test_pairs_by_name():
    names = ["a.weight", "a.weight_scale_inv", "b.weight", "b.weight_scale", "b.weight_scale_2", "b.input_scale",
             "c.weight_packed", "c.weight_scale", "c.weight_global_scale", "experts.gate_up_proj_blocks",
             "experts.gate_up_proj_scales", "d.weight", "d.k_scale", "norm.weight"]
    assert scale_companions(names) == {
        "a.weight": ["a.weight_scale_inv"],
        "b.weight": ["b.weight_scale", "b.weight_scale_2"],
        "c.weight_packed": ["c.weight_global_scale", "c.weight_scale"],
        "experts.gate_up_proj_blocks": ["experts.gate_up_proj_scales"],
    }
    members = quantized_members(names)
    assert "b.input_scale" not in members and "d.weight" not in members and "norm.weight" not in members
    assert members["a.weight_scale_inv"] == "a.weight"


@pytest.mark.parametrize("command", [["global", "--clip", "1"], ["norm", "--clip", "1"], ["average", "--clip", "1"],
                                     ["value", "--min", "-1", "--max", "1"], ["norm", "--clip", "1", "--axes", "1"]])
@pytest.mark.parametrize("make", [deepseek_fp8, nvfp4])
def test_clipping_a_quantized_weight_is_refused(tmp_path, command, make):
    path = tmp_path / "model.safetensors"
    path.write_bytes(safetensors_bytes(make()))
    before = path.read_bytes()
    result = run(*command, path)
    assert result.exit_code == 1, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"Error: {path}: "), result.stderr
    assert W in lines[0] and f"{W}_scale" in lines[0] and "quantized" in lines[0]
    assert "Traceback" not in result.output
    assert path.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.safetensors"]


def test_excluding_the_quantized_weight_clips_the_rest(tmp_path):
    path = tmp_path / "model.safetensors"
    tensors = deepseek_fp8()
    path.write_bytes(safetensors_bytes(tensors))
    result = run("norm", "--clip", "1", "--exclude", f"{W}*", path)
    assert result.exit_code == 0, result.output
    out = read_all(tmp_path / "model.clipped.safetensors")
    assert out[W].tobytes() == tensors[W].tobytes()
    assert out[W + "_scale_inv"].tobytes() == tensors[W + "_scale_inv"].tobytes()
    assert np.isclose(np.linalg.norm(out["model.norm.weight"].astype(np.float64)), 1.0)


def test_report_says_the_norms_are_of_raw_codes(tmp_path):
    path = tmp_path / "model.safetensors"
    path.write_bytes(safetensors_bytes(deepseek_fp8()))
    result = run("report", path)
    assert result.exit_code == 0, result.output
    assert "raw codes" in result.stderr and W in result.stderr
    data = json.loads(run("report", "--json", path).stdout)
    assert any("raw codes" in w for w in data["warnings"])


def test_plain_float8_without_scales_is_clipped_as_before(tmp_path):
    path = tmp_path / "f8.safetensors"
    path.write_bytes(safetensors_bytes({"x.weight": np.full((4, 4), 2.0).astype(ml_dtypes.float8_e4m3fn)}))
    result = run("norm", "--clip", "1", path)
    assert result.exit_code == 0, result.output
    assert "raw codes" not in result.stderr


def test_a_sharded_set_pairs_weight_and_scale_across_shards(tmp_path):
    tensors = deepseek_fp8()
    folder = tmp_path / "ckpt"
    folder.mkdir()
    (folder / "model-00001-of-00002.safetensors").write_bytes(
        safetensors_bytes({W: tensors[W], "model.norm.weight": tensors["model.norm.weight"]}))
    (folder / "model-00002-of-00002.safetensors").write_bytes(
        safetensors_bytes({W + "_scale_inv": tensors[W + "_scale_inv"]}))
    weight_map = {W: "model-00001-of-00002.safetensors", "model.norm.weight": "model-00001-of-00002.safetensors",
                  W + "_scale_inv": "model-00002-of-00002.safetensors"}
    index = folder / "model.safetensors.index.json"
    index.write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    result = run("global", "--clip", "1", index, "--out-dir", tmp_path / "out")
    assert result.exit_code == 1, result.output
    assert W + "_scale_inv" in result.stderr and result.stderr.count("Error:") == 1
    assert not (tmp_path / "out").exists()
    report = run("report", index)
    assert report.exit_code == 0 and "raw codes" in report.stderr
