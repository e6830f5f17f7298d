"""Clipping quantized safetensors by rewriting scales: what the rewrite must land on, and what it must refuse.

A scale rewritten by f is rounded once to its dtype; among float16's subnormals (or below
them) that rounding moves a weight far from f times its old values, or to zero. Such a
rewrite is refused like GGUF's (the weight's or row's exact norm against f x its old norm),
and scales that flush to zero are reported. NVFP4 weights fused by a consumer keep sharing
their global scale even when a selection leaves a member out. Empty weights are weights.
"""

from __future__ import annotations

import json
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

from support import quant_examples
from support.cli import run
from support.formats_helpers import safetensors_bytes


W = "model.layers.17.mlp.down_proj.weight"


def fp8_channel(path: Path, scales: np.ndarray, seed: int = 0) -> float:
    """An FP8 weight with per-row scales (compressed-tensors channel layout); its real norm."""
    rng = np.random.default_rng(seed)
    codes = rng.uniform(-400, 400, (scales.shape[0], 64)).astype(ml_dtypes.float8_e4m3fn)
    path.write_bytes(safetensors_bytes({W: codes, W + "_scale": scales}))
    real = codes.astype(np.float64) * scales.astype(np.float64)
    return float(np.linalg.norm(real))


def stored_scales(path: Path) -> np.ndarray:
    tensors = quant_examples.st_read(str(path))
    return tensors[W + "_scale"].arr


# --------------------------------------------------------------------------- item: scales that land far


@pytest.mark.parametrize("quiet", [False, True])
def test_float16_scales_flushed_to_zero_are_refused(tmp_path, quiet):
    source = tmp_path / "model.safetensors"
    fp8_channel(source, np.full((4, 1), 1e-4, np.float16))
    out = tmp_path / "out.safetensors"
    result = run("norm", "--clip", "1e-5", *(["-q"] if quiet else []), "-o", out, source)
    assert result.exit_code == 1, result.output
    assert result.stderr.startswith(f"Error: {source}: ") and W in result.stderr
    assert "nothing was written" in result.stderr and "Traceback" not in result.stderr
    assert not out.exists()


def test_float16_scales_rounded_among_subnormals_far_from_the_target_are_refused(tmp_path):
    source = tmp_path / "model.safetensors"
    scale = np.float16(1e-4)
    norm = fp8_channel(source, np.full((4, 1), scale, np.float16))
    # f * scale is 1.6 quanta of float16's subnormals: it rounds to 2 quanta, 25% over
    factor = 1.6 * 2.0 ** -24 / float(scale)
    out = tmp_path / "out.safetensors"
    result = run("norm", "--clip", repr(norm * factor), "-o", out, source)
    assert result.exit_code == 1, result.output
    assert W in result.stderr and "2**-9" in result.stderr and not out.exists()


def test_rows_are_checked_one_by_one_with_axes(tmp_path):
    source = tmp_path / "model.safetensors"
    scales = np.array([[1e-4], [1e-4], [1.0], [1.0]], np.float16)
    codes_norm = fp8_channel(source, scales)
    assert codes_norm > 0
    out = tmp_path / "out.safetensors"
    # every row clipped to 1e-5: the rows with scales 1e-4 go to zero, those with 1.0 land well
    result = run("norm", "--clip", "1e-5", "--axes", "1", "-o", out, source)
    assert result.exit_code == 1, result.output
    assert "row 0" in result.stderr and not out.exists()


def test_a_clip_that_lands_within_the_tolerance_is_written(tmp_path):
    source = tmp_path / "model.safetensors"
    norm = fp8_channel(source, np.full((4, 1), 1e-2, np.float16))
    out = tmp_path / "out.safetensors"
    result = run("norm", "--clip", norm / 3, "--json", "-o", out, source)
    assert result.exit_code == 0, result.stderr
    entry = json.loads(result.stdout)["tensors"][0]
    assert entry["norm_after"] == pytest.approx(norm / 3, rel=2.0 ** -9)
    assert "flushed" not in result.stderr


def test_scales_flushed_to_zero_are_reported(tmp_path):
    """One row's scale is float16's smallest subnormal: a clip by 0.1 makes it 0 (its values
    too) while the weight's norm, held by the other rows, lands: written, with the warning."""
    source = tmp_path / "model.safetensors"
    scales = np.array([[2.0 ** -24], [1e-2], [1e-2], [1e-2]], np.float16)
    norm = fp8_channel(source, scales)
    out = tmp_path / "out.safetensors"
    result = run("norm", "--clip", norm / 10, "-o", out, source)
    assert result.exit_code == 0, result.output
    assert "flushed non-zero values to 0" in result.stderr and W in result.stderr
    assert "64 of 256 values" in result.stderr
    assert stored_scales(out)[0, 0] == 0


# --------------------------------------------------------------------------- item: fused groups split by a selection


@pytest.fixture(scope="module")
def nvfp4(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("nvfp4")
    return {name: Path(folder) for name, folder in
            quant_examples.build(str(root), ["modelopt_nvfp4", "ct_nvfp4"]).items()}


@pytest.mark.parametrize("name", ["modelopt_nvfp4", "ct_nvfp4", "modelopt_nvfp4_sharded"])
def test_a_fused_group_split_by_exclude_is_refused(nvfp4, tmp_path, name):
    folder = nvfp4[name]
    source = folder / ("model.safetensors.index.json" if name.endswith("sharded") else "model.safetensors")
    out = tmp_path / "out"
    result = run("global", "--clip", 1, "--exclude", "*k_proj*", "--out-dir", out, source)
    assert result.exit_code == 1, result.output
    first = result.stderr.splitlines()[0]
    assert first.startswith("Error: ") and len(result.stderr.splitlines()) == 1
    assert "model.layers.0.self_attn.k_proj.weight" in first  # the member left out
    assert "model.layers.0.self_attn.q_proj.weight" in first  # and the group it belongs to
    assert "model.layers.0.self_attn.v_proj.weight" in first
    assert not out.exists() or not any(out.iterdir())


def test_a_fused_group_left_out_whole_is_clipped(nvfp4, tmp_path):
    source = nvfp4["modelopt_nvfp4"] / "model.safetensors"
    out = tmp_path / "out"
    result = run("global", "--clip", 1, "--exclude", "*self_attn.[qkv]_proj*", "--out-dir", out, source)
    assert result.exit_code == 0, result.stderr


def test_a_fused_group_split_by_exclude_is_fine_when_nothing_is_clipped(nvfp4, tmp_path):
    source = nvfp4["modelopt_nvfp4"] / "model.safetensors"
    out = tmp_path / "out"
    result = run("global", "--clip", 1e6, "--exclude", "*k_proj*", "--out-dir", out, source)
    assert result.exit_code == 0, result.stderr


# --------------------------------------------------------------------------- item: empty weights


@pytest.mark.parametrize("shape, scale_shape", [((4, 0), (4, 1)), ((0, 32), (0, 1)), ((4, 0), (1,))])
def test_an_empty_fp8_weight_is_an_empty_tensor(tmp_path, shape, scale_shape):
    source = tmp_path / "model.safetensors"
    source.write_bytes(safetensors_bytes({W: np.zeros(shape, ml_dtypes.float8_e4m3fn),
                                          W + "_scale": np.full(scale_shape, 1e-2, np.float32),
                                          "model.norm.weight": np.full(8, 2.0, np.float32)}))
    for command in (["report", "--json"], ["info", "--json"]):
        result = run(*command, source)
        assert result.exit_code == 0, result.output
        tensors = {t["name"]: t for t in json.loads(result.stdout)["tensors"]}
        assert tensors[W]["shape"] == list(shape)
        if command[0] == "report":
            assert tensors[W]["norm"] == 0 and tensors[W]["skipped"] is None
    for command in (["norm", "--clip", "1"], ["global", "--clip", "1"]):
        out = tmp_path / f"{command[0]}.safetensors"
        result = run(*command, "--json", "-o", out, source)
        assert result.exit_code == 0, result.output
        data = json.loads(result.stdout)
        assert data["global_norm_after"] == pytest.approx(1.0)


@pytest.mark.parametrize("in_place", [True, False])
def test_a_set_checks_a_rescale_that_may_miss_before_writing_any_file(tmp_path, in_place):
    """Codes and float16 scales in one shard, a plain tensor in the other: the miss is found
    before either shard is written (in place, no shard may be replaced before it fails)."""
    rng = np.random.default_rng(4)
    codes = rng.uniform(-400, 400, (4, 64)).astype(ml_dtypes.float8_e4m3fn)
    shards = {"model-00001-of-00002.safetensors": {"model.embed_tokens.weight": np.full((8, 8), 3.0, np.float32)},
              "model-00002-of-00002.safetensors": {W: codes, W + "_scale": np.full((4, 1), 1e-4, np.float16)}}
    weight_map = {}
    for file, tensors in shards.items():
        (tmp_path / file).write_bytes(safetensors_bytes(tensors))
        weight_map.update({name: file for name in tensors})
    index = tmp_path / "model.safetensors.index.json"
    index.write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    before = {file: (tmp_path / file).read_bytes() for file in shards}
    out = tmp_path / "out"
    args = ["--in-place"] if in_place else ["--out-dir", out]
    result = run("norm", "--clip", "1e-5", *args, index)
    assert result.exit_code == 1, result.output
    assert W in result.stderr and "nothing was written" in result.stderr
    assert {file: (tmp_path / file).read_bytes() for file in shards} == before
    assert not out.exists() or not any(out.iterdir())
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([*shards, index.name])
