"""Quantized checkpoints (issue 16): norms of the real weights, the gate on scales, clipping by scales only.

Most tests run on the examples of :mod:`quant_examples` (every convention, one file and a
sharded set with codes and scales in different shards), whose ``expected.json`` holds norms
from a float64 dequantization that does not use tclip's code.
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

from support import quant_examples
from support.cli import run
from support.formats_helpers import read_all, safetensors_bytes
from tclip.quant.codes import round_product, round_quotient

UNDERSTOOD = ["deepseek_fp8_block", "deepseek_fp8_block_ue8m0", "ct_fp8_tensor", "ct_fp8_channel", "ct_fp8_block",
              "ct_nvfp4", "ct_mxfp4", "modelopt_fp8", "modelopt_nvfp4", "gptoss_mxfp4"]
EVERY = [*UNDERSTOOD, "ct_w4a16_asym_packed", "dtype_zoo"]
MX = {"ct_mxfp4", "gptoss_mxfp4"}
FUSED_GLOBAL = {"ct_nvfp4", "modelopt_nvfp4"}
W = "model.layers.17.self_attn.k_proj.weight"


def report_json(*args) -> dict:
    result = run("report", "--json", *args)
    assert result.exit_code == 0, result.stderr
    return json.loads(result.stdout)


@pytest.fixture(scope="session")
def examples(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("quant_examples")
    return {name: Path(folder) for name, folder in quant_examples.build(str(root)).items()}


def expected(folder: Path) -> dict:
    return json.loads((folder / "expected.json").read_text())


def target(folder: Path) -> Path:
    index = folder / "model.safetensors.index.json"
    return index if index.exists() else folder / "model.safetensors"


def copy_of(folder: Path, tmp_path: Path) -> Path:
    out = tmp_path / folder.name
    shutil.copytree(folder, out)
    return out


def stored(folder: Path) -> dict:
    """Every stored tensor of a checkpoint, read by the examples' own parser (raw dtypes)."""
    tensors, _ = quant_examples.load_dir(str(folder))
    return {name: t.arr for name, t in tensors.items()}


# --------------------------------------------------------------------------- norms


@pytest.mark.parametrize("sharded", [False, True])
@pytest.mark.parametrize("name", EVERY)
def test_norms_are_those_of_the_real_weights(examples, name, sharded):
    folder = examples[name + ("_sharded" if sharded else "")]
    want = expected(folder)
    data = report_json(target(folder))
    tensors = {t["name"]: t for t in data["tensors"]}
    roles = want["stored_tensor_roles"]
    for real, facts in want["real_weights"].items():
        entry = tensors[real]
        if name == "ct_w4a16_asym_packed" and facts["quantized"]:
            assert entry["norm"] is None and "not measured" in entry["skipped"]  # recognised, not understood
            continue
        assert entry["norm"] == pytest.approx(facts["norm"], rel=1e-13, abs=1e-300), real
        assert entry["shape"] == facts["shape"]
        if facts["quantized"]:
            parts = [p["name"] for p in entry["quantization"]["parts"]]
            assert facts["stored_as"] == parts[0]
            assert all(roles[p] == "weight-scale/aux" for p in parts[1:])
    for stored_name, role in roles.items():
        if role == "activation/kv-scale (not a weight)":
            assert tensors[stored_name]["skipped"] == "activation scale (not a weight)"
            assert tensors[stored_name]["norm"] is None
        elif role == "weight-scale/aux":
            assert stored_name not in tensors  # shown as a part of its weight, never as a tensor
    if name != "ct_w4a16_asym_packed":
        assert data["global_norm"] == pytest.approx(want["global_norm"], rel=1e-13)


@pytest.mark.parametrize("name", ["deepseek_fp8_block", "ct_fp8_channel", "ct_nvfp4", "gptoss_mxfp4"])
def test_stats_and_row_norms_of_quantized_weights(examples, name):
    folder = examples[name]
    real, _, _, _, _ = quant_examples.dequant_dir(str(folder))
    data = report_json("--stats", "--axes", "-1", target(folder))
    for entry in data["tensors"]:
        if "quantization" not in entry:
            continue
        values = real[entry["name"]]
        rows = np.sqrt(np.sum(values.reshape(-1, values.shape[-1]) ** 2, axis=1))
        assert entry["max_slice_norm"] == pytest.approx(rows.max(), rel=1e-13)
        assert entry["min_slice_norm"] == pytest.approx(rows.min(), rel=1e-13)
        assert entry["mean"] == pytest.approx(values.mean(), rel=1e-9, abs=1e-15)
        assert entry["zeros"] == int(np.count_nonzero(values == 0))
        assert entry["max"] == values.max() and entry["min"] == values.min()
        assert entry["max_abs"] == np.abs(values).max()


def test_results_are_the_same_bits_for_any_memory_and_threads(tmp_path):
    rng = np.random.default_rng(7)
    codes = (rng.standard_normal((1000, 3000)) * 60).clip(-448, 448).astype(ml_dtypes.float8_e4m3fn)
    scales = rng.uniform(1e-4, 1e-2, (8, 24)).astype(np.float32)
    path = tmp_path / "model.safetensors"
    path.write_bytes(safetensors_bytes({W: codes, W + "_scale_inv": scales}))
    runs = [report_json(*flags, "--axes", "1", path)["tensors"][0]
            for flags in ([], ["--memory", "16M", "--threads", "1"], ["--memory", "20M", "--threads", "3"])]
    assert runs[0] == runs[1] == runs[2]
    whole = [report_json(*flags, path)["tensors"][0]["norm"] for flags in ([], ["--memory", "16M", "--threads", "1"])]
    assert whole[0] == whole[1]
    real = codes.astype(np.float64) * np.repeat(np.repeat(scales.astype(np.float64), 128, 0), 128, 1)[:1000, :3000]
    assert whole[0] == pytest.approx(float(np.linalg.norm(real)), rel=1e-14)


@pytest.mark.parametrize("sharded", [False, True])
def test_info_names_each_weights_scheme(examples, sharded):
    folder = examples["modelopt_nvfp4" + ("_sharded" if sharded else "")]
    result = run("info", "--json", target(folder))
    assert result.exit_code == 0, result.stderr
    tensors = {t["name"]: t for t in json.loads(result.stdout)["tensors"]}
    weight = tensors["model.layers.0.self_attn.q_proj.weight"]
    assert weight["shape"] == [256, 256] and weight["dtype"] == "nvfp4 xe4m3 1x16 xf32"
    assert weight["quantization"]["convention"] == "ModelOpt NVFP4"
    assert [(p["name"].rsplit(".", 1)[1], p["role"]) for p in weight["quantization"]["parts"]] == [
        ("weight", "codes"), ("weight_scale", "scales"), ("weight_scale_2", "global scale")]
    assert "model.layers.0.self_attn.q_proj.weight_scale" not in tensors
    assert tensors["model.layers.0.self_attn.k_proj.k_scale"]["role"] == "activation scale (not a weight)"
    people = run("info", target(folder))
    assert "nvfp4 xe4m3 1x16 xf32" in people.stdout


# --------------------------------------------------------------------------- clipping by scales


def _scale_parts(entry: dict) -> list[str]:
    return [p["name"] for p in entry["quantization"]["parts"][1:]]


@pytest.mark.parametrize("sharded", [False, True])
@pytest.mark.parametrize("name", [n for n in UNDERSTOOD if n not in MX])
def test_global_clip_rewrites_only_scales(examples, tmp_path, name, sharded):
    torch = pytest.importorskip("torch")
    from safetensors.torch import load_file

    folder = copy_of(examples[name + ("_sharded" if sharded else "")], tmp_path)
    before = report_json(target(folder))
    clip = before["global_norm"] / 2
    out = tmp_path / "out"
    args = ["--out-dir", out] if sharded else ["-o", out / "model.safetensors"]
    out.mkdir()
    result = run("global", "--clip", clip, "--json", *args, target(folder))
    assert result.exit_code == 0, result.stderr
    clipped = json.loads(result.stdout)
    factor = clip / before["global_norm"]
    old, new = stored(folder), stored(out)
    assert set(old) == set(new)
    rescaled = set()
    for entry in before["tensors"]:
        if "quantization" not in entry:
            continue
        parts = entry["quantization"]["parts"]
        assert old[parts[0]["name"]].tobytes() == new[parts[0]["name"]].tobytes()  # codes byte for byte
        changed = [p["name"] for p in parts if old[p["name"]].tobytes() != new[p["name"]].tobytes()]
        assert len(changed) == 1, changed
        part = changed[0]
        rescaled.add(part)
        was, now = old[part], new[part]
        if part.endswith("_global_scale"):  # compressed-tensors NVFP4: the global scale divides
            assert now.reshape(-1)[0] == round_quotient(float(was.reshape(-1)[0]), factor, was.dtype)
        else:
            assert np.array_equal(now, (was.astype(np.float64) * factor).astype(was.dtype))
    for stored_name in set(old) - rescaled:  # everything else: untouched or a plain tensor scaled
        if any(stored_name == t["name"] and "quantization" not in t for t in before["tensors"]):
            continue
        assert old[stored_name].tobytes() == new[stored_name].tobytes(), stored_name
    after = report_json(target(out))
    tensors_after = {t["name"]: t for t in after["tensors"]}
    for entry in before["tensors"]:
        if "quantization" in entry:
            scale_dtype = entry["dtype"]
            tolerance = 4e-3 if "bf16" in scale_dtype else 1e-6
            assert tensors_after[entry["name"]]["norm"] == pytest.approx(entry["norm"] * factor, rel=tolerance)
            reported = next(t for t in clipped["tensors"] if t["name"] == entry["name"])
            assert reported["norm_after"] == tensors_after[entry["name"]]["norm"]  # from what was written
    for file in out.glob("*.safetensors"):
        assert isinstance(load_file(file), dict)  # a valid file for the safetensors library
    assert torch is not None


@pytest.mark.parametrize("name", ["deepseek_fp8_block", "ct_fp8_block", "modelopt_fp8", "ct_fp8_tensor"])
def test_norm_clip_per_weight_reaches_the_limit(examples, tmp_path, name):
    folder = copy_of(examples[name], tmp_path)
    result = run("norm", "--clip", "3", "--json", "--exclude", "*gate_proj*", "--exclude", "*up_proj*",
                 "--exclude", "*q_proj*", "--exclude", "*k_proj*", "--exclude", "*v_proj*", target(folder))
    assert result.exit_code == 0, result.stderr
    after = report_json(folder / "model.clipped.safetensors")
    for entry in after["tensors"]:
        if "quantization" in entry and entry["skipped"] is None and not any(
                k in entry["name"] for k in ("gate_proj", "up_proj", "q_proj", "k_proj", "v_proj")):
            tolerance = 4e-3 if "bf16" in entry["dtype"] else 1e-6
            assert entry["norm"] == pytest.approx(3.0, rel=tolerance) or entry["norm"] < 3.0


def test_per_row_clip_where_scales_are_per_row(examples, tmp_path):
    folder = copy_of(examples["ct_fp8_channel"], tmp_path)
    result = run("norm", "--clip", "0.5", "--axes", "1", "-q", target(folder))
    assert result.exit_code == 0, result.stderr
    real, _, _, _, _ = quant_examples.dequant_dir(str(folder))
    (folder / "model.safetensors").unlink()
    (folder / "model.clipped.safetensors").rename(folder / "model.safetensors")
    clipped, _, _, _, _ = quant_examples.dequant_dir(str(folder))
    name = "model.layers.0.mlp.down_proj.weight"
    rows_before = np.linalg.norm(real[name], axis=1)
    rows_after = np.linalg.norm(clipped[name], axis=1)
    over = rows_before > 0.5
    assert over.any()
    assert rows_after[over] == pytest.approx(np.full(over.sum(), 0.5), rel=2 ** -8)
    assert np.array_equal(rows_after[~over], rows_before[~over])


@pytest.mark.parametrize("name, command, words", [
    ("deepseek_fp8_block", ["norm", "--clip", "1", "--axes", "1"], "one scale serves several rows"),
    ("ct_fp8_channel", ["norm", "--clip", "1", "--axes", "0"], "only rows"),
    ("modelopt_nvfp4", ["norm", "--clip", "0.01", "--axes", "1"], "one scale serves several rows"),
    ("deepseek_fp8_block", ["value", "--min", "-0.01", "--max", "0.01"], "requantized"),
    ("gptoss_mxfp4", ["global", "--clip", "10"], "powers of two"),
    ("ct_mxfp4", ["norm", "--clip", "1"], "powers of two"),
    ("ct_nvfp4", ["norm", "--clip", "1"], "share one NVFP4 global scale"),
    ("modelopt_nvfp4", ["average", "--clip", "1e-6"], "share one NVFP4 global scale"),
    ("ct_w4a16_asym_packed", ["global", "--clip", "1"], "tclip cannot read it"),
])
@pytest.mark.parametrize("sharded", [False, True])
def test_what_scales_cannot_do_is_refused(examples, tmp_path, name, command, words, sharded):
    folder = copy_of(examples[name + ("_sharded" if sharded else "")], tmp_path)
    files = {p: p.read_bytes() for p in folder.iterdir()}
    out = tmp_path / "out"
    result = run(*command, *(["--out-dir", out] if sharded else []), target(folder))
    assert result.exit_code == 1, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("Error: ") and words in lines[0], result.stderr
    assert "nothing was written" in lines[0] and "Traceback" not in result.output
    assert {p: p.read_bytes() for p in folder.iterdir()} == files
    assert not out.exists()


def test_value_clip_that_changes_nothing_is_exact(examples, tmp_path):
    folder = copy_of(examples["deepseek_fp8_block"], tmp_path)
    result = run("value", "--min", "-100", "--max", "100", "-q", target(folder))
    assert result.exit_code == 0, result.stderr
    assert stored(folder).keys() == read_all(folder / "model.clipped.safetensors").keys()


@pytest.mark.parametrize("name", sorted(MX))
def test_a_power_of_two_factor_shifts_e8m0_scales_exactly(examples, tmp_path, name):
    folder = copy_of(examples[name], tmp_path)
    before = report_json(target(folder))
    result = run("global", "--clip", before["global_norm"] / 2, "--use-norm", before["global_norm"], "-q",
                 "--include", "*proj*", target(folder))
    assert result.exit_code == 0, result.stderr
    old, new = stored(folder), read_all(folder / "model.clipped.safetensors")
    for entry in before["tensors"]:
        if "quantization" not in entry:
            continue
        codes, scales = _scale_parts(entry) and entry["quantization"]["parts"][0]["name"], _scale_parts(entry)[0]
        assert new[codes].tobytes() == old[codes].tobytes()
        assert np.array_equal(new[scales].view(np.uint8), old[scales].view(np.uint8) - 1)
    after = {t["name"]: t for t in report_json(folder / "model.clipped.safetensors")["tensors"]}
    for entry in before["tensors"]:
        if "quantization" in entry:
            assert after[entry["name"]]["norm"] == entry["norm"] / 2


def test_fused_nvfp4_weights_clipped_together_keep_one_global_scale(examples, tmp_path):
    folder = copy_of(examples["modelopt_nvfp4"], tmp_path)
    result = run("global", "--clip", "10", "-q", target(folder))
    assert result.exit_code == 0, result.stderr
    new = read_all(folder / "model.clipped.safetensors")
    group = [new[f"model.layers.0.self_attn.{m}_proj.weight_scale_2"] for m in "qkv"]
    assert group[0] == group[1] == group[2]


# --------------------------------------------------------------------------- the gate sees the scales


def deepseek_layer(scales: np.ndarray | None = None, codes: np.ndarray | None = None) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(16)
    if codes is None:
        codes = (rng.standard_normal((256, 200)) * 100).clip(-448, 448).astype(ml_dtypes.float8_e4m3fn)
    if scales is None:
        scales = np.array([[0.01, 0.02], [0.03, 0.04]], np.float32)
    return {W: codes, W + "_scale_inv": scales, "model.norm.weight": rng.standard_normal(256).astype(np.float32)}


def test_a_nan_scale_fails_the_gate_naming_weight_scale_and_block(tmp_path):
    path = tmp_path / "model.safetensors"
    path.write_bytes(safetensors_bytes(deepseek_layer(np.array([[0.01, 0.02], [np.nan, 0.04]], np.float32))))
    result = run("report", "--max-norm", "1e9", "-q", path)
    assert result.exit_code == 3, result.output
    line = result.stderr.strip()
    assert W in line and f"NaN scale in {W}_scale_inv block [1, 0]" in line, line
    data = report_json(path)
    weight = next(t for t in data["tensors"] if t["name"] == W)
    assert weight["nonfinite"]["nan"] == 128 * 128 and weight["quantization"]["scales"][0]["first_bad"] == [1, 0]


def test_a_nan_code_fails_the_gate_naming_its_row_and_column(tmp_path):
    codes = deepseek_layer()[W].copy()
    codes.view(np.uint8)[130, 17] = 0x7F  # E4M3 NaN
    codes.view(np.uint8)[200, 3] = 0xFF
    path = tmp_path / "model.safetensors"
    path.write_bytes(safetensors_bytes(deepseek_layer(codes=codes)))
    result = run("report", "--max-norm", "1e9", "-q", path)
    assert result.exit_code == 3, result.output
    assert f"2 NaN code(s) in {W}, first at row 130, column 17" in result.stderr, result.stderr
    clip = run("global", "--clip", "1", path)
    assert clip.exit_code == 1 and "NaN code(s)" in clip.stderr


def test_a_zero_scale_is_a_warning_naming_weight_and_count(tmp_path):
    path = tmp_path / "model.safetensors"
    path.write_bytes(safetensors_bytes(deepseek_layer(np.array([[0.01, 0.0], [0.0, 0.04]], np.float32))))
    result = run("report", "--max-norm", "1e9", path)
    assert result.exit_code == 0, result.output
    assert f"{W}: 2 zero scale(s) in {W}_scale_inv" in result.stderr and "first at block [0, 1]" in result.stderr


def test_a_weight_not_understood_is_not_measured_and_fails_the_gate(examples):
    folder = examples["ct_w4a16_asym_packed"]
    result = run("report", "--max-norm", "1e9", "-q", target(folder))
    assert result.exit_code == 3, result.output
    assert "not measured: model.layers.0.mlp.down_proj.weight" in result.stderr
    assert run("report", "--max-norm", "1e9", "--exclude", "model.layers.*_proj.weight", "-q",
               target(folder)).exit_code == 0


def test_excluding_a_weight_not_understood_clips_the_rest(examples, tmp_path):
    folder = copy_of(examples["ct_w4a16_asym_packed"], tmp_path)
    result = run("norm", "--clip", "1", "--exclude", "model.layers.*_proj.weight", "-q", target(folder))
    assert result.exit_code == 0, result.stderr
    old, new = stored(folder), read_all(folder / "model.clipped.safetensors")
    assert all(new[n].tobytes() == old[n].tobytes() for n in old if "_proj" in n)


# --------------------------------------------------------------------------- diff across encodings


def test_diff_compares_real_weights_and_never_lists_scales(examples, tmp_path):
    fp8 = examples["deepseek_fp8_block"]
    real, _, _, _, _ = quant_examples.dequant_dir(str(fp8))
    original = {n: v.astype(ml_dtypes.bfloat16) for n, v in real.items()}
    name = "model.layers.0.mlp.down_proj.weight"
    original[name] = (real[name] * 1.01).astype(ml_dtypes.bfloat16)
    path = tmp_path / "original.safetensors"
    path.write_bytes(safetensors_bytes(original))
    result = run("diff", "--json", path, target(fp8))
    assert result.exit_code == 3, result.stderr
    data = json.loads(result.stdout)
    assert data["only_in_a"] == [] and data["only_in_b"] == [] and data["shape_differs"] == []
    entry = next(t for t in data["tensors"] if t["name"] == name)
    a = original[name].astype(np.float64)
    assert entry["diff_norm"] == pytest.approx(float(np.linalg.norm(a - real[name])), rel=1e-12)
    assert entry["relative"] == pytest.approx(float(np.linalg.norm(a - real[name]) / np.linalg.norm(a)), rel=1e-12)
    same = json.loads(run("diff", "--json", target(fp8), target(examples["deepseek_fp8_block_sharded"])).stdout)
    assert same["tensors_differing"] == 0 and same["tensors_compared"] == len(real)  # the file metadata differ
    codes = sum(p.stat().st_size for p in fp8.glob("*.safetensors"))
    assert same["bytes_read"] < 2.5 * codes  # what was read, not the float64 values compared


# --------------------------------------------------------------------------- dtypes


def test_plain_float8_without_scales_is_clipped_as_before(tmp_path):
    path = tmp_path / "f8.safetensors"
    path.write_bytes(safetensors_bytes({"x.weight": np.full((4, 4), 2.0).astype(ml_dtypes.float8_e4m3fn)}))
    result = run("norm", "--clip", "1", "-q", path)
    assert result.exit_code == 0, result.output
    out = read_all(tmp_path / "f8.clipped.safetensors")["x.weight"]
    assert np.array_equal(out.astype(np.float64), np.full((4, 4), 0.25))


@pytest.mark.parametrize("dtype", [ml_dtypes.float8_e4m3fnuz, ml_dtypes.float8_e5m2fnuz, ml_dtypes.float8_e5m2,
                                   np.int8])
def test_other_code_dtypes_with_scales(tmp_path, dtype):
    rng = np.random.default_rng(3)
    codes = (rng.standard_normal((64, 48)) * 20).clip(-100, 100).astype(dtype)
    scales = rng.uniform(0.5, 2, (64, 1)).astype(np.float32)
    path = tmp_path / "model.safetensors"
    code = {np.dtype(np.int8): "I8", np.dtype(ml_dtypes.float8_e5m2): "F8_E5M2",
            np.dtype(ml_dtypes.float8_e4m3fnuz): "F8_E4M3FNUZ", np.dtype(ml_dtypes.float8_e5m2fnuz): "F8_E5M2FNUZ"}
    quant_examples.st_write(str(path), {W: quant_examples.T(code[codes.dtype], codes),
                                        W + "_scale": quant_examples.T("F32", scales)})
    data = report_json(path)
    real = codes.astype(np.float64) * scales.astype(np.float64)
    assert data["tensors"][0]["norm"] == pytest.approx(float(np.linalg.norm(real)), rel=1e-14)
    assert data["tensors"][0]["dtype"].endswith("xf32 row")


def test_e8m0_scales_stored_as_f8_e8m0(tmp_path):
    rng = np.random.default_rng(5)
    packed = rng.integers(0, 256, (32, 64), dtype=np.uint8)
    exponents = rng.integers(120, 130, (32, 4), dtype=np.uint8)
    path = tmp_path / "model.safetensors"
    quant_examples.st_write(str(path), {"m.weight_packed": quant_examples.T("U8", packed),
                                        "m.weight_scale": quant_examples.T("F8_E8M0", exponents)})
    lut = quant_examples.E2M1
    values = np.stack([lut[packed & 15], lut[packed >> 4]], axis=-1).reshape(32, 128)
    real = values * np.repeat(np.ldexp(1.0, exponents.astype(int) - 127), 32, axis=1)
    data = report_json(path)
    assert data["tensors"][0]["name"] == "m.weight"
    assert data["tensors"][0]["norm"] == float(np.linalg.norm(real))


# --------------------------------------------------------------------------- rounding once


def test_round_product_rounds_the_exact_product_once():
    # 3 * f rounds in float64 to 1 + 2**-24, exactly halfway between two float32s; the exact
    # product is above it for one f and below for its neighbour: up and down, never to even.
    up = (1 + 2 ** -24) / 3
    down = math.nextafter(up, 0)
    assert 3.0 * up == 3.0 * down == 1 + 2 ** -24
    got = round_product(np.array([3.0, 3.0]), np.array([up, down]), np.dtype(np.float32))
    assert got.dtype == np.float32
    assert got.tolist() == [1 + 2 ** -23, 1.0]
    assert np.float32(3.0 * up) == 1.0  # what rounding the float64 product again gives
    bf = round_product(np.array([3.0, 3.0]), np.array([(1 + 2 ** -8) / 3, math.nextafter((1 + 2 ** -8) / 3, 0)]),
                       np.dtype(ml_dtypes.bfloat16))
    assert bf.astype(np.float64).tolist() == [1 + 2 ** -7, 1.0]


def test_round_quotient_is_the_nearest_float32():
    for value, divisor in ((1.0, 3.0), (2.0 ** -126, 7.0), (448.0 * 6 / 0.37, 0.5)):
        got = float(round_quotient(value, divisor, np.dtype(np.float32)))
        exact = value / divisor
        neighbours = np.nextafter(np.float32(got), np.array([-np.inf, np.inf], np.float32)).astype(np.float64)
        assert all(abs(got - exact) <= abs(n - exact) for n in neighbours)
        assert math.isfinite(got)


def test_excluding_a_quantized_weight_clips_the_rest(tmp_path):
    path = tmp_path / "model.safetensors"
    tensors = deepseek_layer()
    path.write_bytes(safetensors_bytes(tensors))
    result = run("norm", "--clip", "1", "--exclude", W, "-q", path)
    assert result.exit_code == 0, result.output
    out = read_all(tmp_path / "model.clipped.safetensors")
    assert out[W].tobytes() == tensors[W].tobytes()
    assert out[W + "_scale_inv"].tobytes() == tensors[W + "_scale_inv"].tobytes()
    assert np.isclose(np.linalg.norm(out["model.norm.weight"].astype(np.float64)), 1.0)


def test_nvfp4_without_a_config_by_names_dtypes_and_shapes(tmp_path):
    rng = np.random.default_rng(16)
    packed = rng.integers(0, 256, (64, 32), dtype=np.uint8)
    scales = rng.uniform(0.1, 4, (64, 4)).astype(ml_dtypes.float8_e4m3fn)
    path = tmp_path / "model.safetensors"
    path.write_bytes(safetensors_bytes({W: packed, W + "_scale": scales, W + "_scale_2": np.array(0.002, np.float32),
                                        "model.layers.17.self_attn.k_proj.input_scale": np.array(0.5, np.float32)}))
    lut = quant_examples.E2M1
    values = np.stack([lut[packed & 15], lut[packed >> 4]], axis=-1).reshape(64, 64)
    real = values * np.repeat(scales.astype(np.float64), 16, axis=1) * np.float64(np.float32(0.002))
    data = report_json(path)
    weight = data["tensors"][1]
    assert weight["name"] == W and weight["shape"] == [64, 64] and weight["dtype"] == "nvfp4 xe4m3 1x16 xf32"
    assert weight["norm"] == pytest.approx(float(np.linalg.norm(real)), rel=1e-14)
    assert data["global_norm"] == weight["norm"]  # the activation scale is no weight


# --------------------------------------------------------------------------- detection


@pytest.mark.parametrize("name, shard, words", [
    ("deepseek_fp8_block", "model-00001-of-00002.safetensors", "its scales are not in this file"),
    ("deepseek_fp8_block", "model-00002-of-00002.safetensors", "its codes are not in this file"),
    ("modelopt_nvfp4", "model-00001-of-00002.safetensors", "its scales are not in this file"),
    ("gptoss_mxfp4", "model-00002-of-00002.safetensors", "its codes are not in this file"),
])
def test_one_shard_opened_alone_is_never_measured_nor_clipped_as_values(examples, tmp_path, name, shard, words):
    folder = copy_of(examples[name + "_sharded"], tmp_path)
    before = {p: p.read_bytes() for p in folder.iterdir()}
    gate = run("report", "--max-norm", "1e9", "-q", folder / shard)
    assert gate.exit_code == 3 and "not measured" in gate.stderr and words in gate.stderr, gate.output
    clip = run("global", "--clip", "1", folder / shard)
    assert clip.exit_code == 1 and words in clip.stderr, clip.output
    assert {p: p.read_bytes() for p in folder.iterdir()} == before


def test_a_plain_weight_beside_a_weight_scale_stays_plain(tmp_path):
    rng = np.random.default_rng(1)
    weight = rng.standard_normal((8, 8)).astype(np.float32)
    path = tmp_path / "model.safetensors"
    path.write_bytes(safetensors_bytes({"layer.weight": weight, "layer.weight_scale": np.ones(1, np.float32)}))
    data = report_json(path)
    assert [(t["name"], t["dtype"]) for t in data["tensors"]] == [("layer.weight", "float32"),
                                                                  ("layer.weight_scale", "float32")]
    assert data["global_norm"] == pytest.approx(math.sqrt(float(np.sum(weight.astype(np.float64) ** 2)) + 1))


def test_modelopt_block_scales_of_four_dimensions_and_fused_experts(tmp_path):
    rng = np.random.default_rng(2)
    codes = (rng.standard_normal((256, 384)) * 50).clip(-448, 448).astype(ml_dtypes.float8_e4m3fn)
    blocks = rng.uniform(1e-3, 1e-2, (2, 1, 3, 1)).astype(np.float32)
    experts = (rng.standard_normal((3, 200, 256)) * 50).clip(-448, 448).astype(ml_dtypes.float8_e4m3fn)
    expert_scales = rng.uniform(1e-3, 1e-2, (3, 2, 2)).astype(np.float32)
    path = tmp_path / "model.safetensors"
    path.write_bytes(safetensors_bytes({"a.weight": codes, "a.weight_scale": blocks,
                                        "mlp.experts.gate_up_proj": experts,
                                        "mlp.experts.gate_up_proj_scales_inv": expert_scales}))
    tensors = {t["name"]: t for t in report_json(path)["tensors"]}
    real = codes.astype(np.float64) * np.repeat(np.repeat(blocks.reshape(2, 3).astype(np.float64), 128, 0), 128, 1)
    assert tensors["a.weight"]["norm"] == pytest.approx(float(np.linalg.norm(real)), rel=1e-14)
    assert tensors["a.weight"]["dtype"] == "e4m3 xf32 128x128"
    full = np.repeat(np.repeat(expert_scales.astype(np.float64), 128, 1), 128, 2)[:, :200, :256]
    assert tensors["mlp.experts.gate_up_proj"]["norm"] == pytest.approx(
        float(np.linalg.norm(experts.astype(np.float64) * full)), rel=1e-14)


def test_gptq_weights_are_recognised_and_not_measured(tmp_path):
    path = tmp_path / "model.safetensors"
    path.write_bytes(safetensors_bytes({"l.qweight": np.zeros((16, 64), np.int32), "l.qzeros": np.zeros((1, 64),
                                        np.int32), "l.scales": np.ones((1, 512), np.float16),
                                        "l.bias": np.ones(512, np.float16)}))
    data = report_json(path)
    tensors = {t["name"]: t for t in data["tensors"]}
    assert set(tensors) == {"l.weight", "l.bias"}
    assert tensors["l.weight"]["norm"] is None and "not measured" in tensors["l.weight"]["skipped"]


def test_a_quantized_set_on_a_dask_cluster_gives_the_same_bytes(examples, tmp_path):
    """Only picklable statistics and the layout cross to the workers; weights and scales in two shards."""
    import subprocess
    import sys

    distributed = pytest.importorskip("dask.distributed")
    folder = examples["modelopt_nvfp4_sharded"]
    # dashboard on a free port (None still takes 8787, and fails where another cluster has it)
    with distributed.LocalCluster(n_workers=2, threads_per_worker=1, processes=True, host="127.0.0.1",
                                  dashboard_address=":0", silence_logs=50) as local:
        result = subprocess.run([sys.executable, "-m", "tclip", "global", "--clip", "10", "--dask",
                                 local.scheduler_address, "--out-dir", str(tmp_path / "out"), str(target(folder))],
                                capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert run("global", "--clip", "10", "-q", "--out-dir", tmp_path / "ref", target(folder)).exit_code == 0
    for shard in (tmp_path / "ref").glob("*.safetensors"):
        assert (tmp_path / "out" / shard.name).read_bytes() == shard.read_bytes()
    assert report_json(tmp_path / "out")["global_norm"] == pytest.approx(10, rel=1e-3)  # bfloat16 tensors round


@pytest.mark.parametrize("name", ["deepseek_fp8_block", "ct_nvfp4", "modelopt_nvfp4"])
def test_a_nan_norm_propagates_to_quantized_weights_through_their_scales(examples, tmp_path, name):
    """--nonfinite propagate gives TensorFlow's result: a NaN global norm makes every weight NaN,
    here by making its scale NaN (codes untouched)."""
    folder = copy_of(examples[name], tmp_path)
    tensors = stored(folder)
    codes = next(n for n, a in tensors.items() if n.endswith(("weight", "weight_packed")) and a.dtype.itemsize == 1
                 and n + "_scale_inv" in tensors or n.endswith("weight_packed") or (n + "_scale_2") in tensors)
    tensors[codes] = tensors[codes].copy()
    if tensors[codes].dtype == np.uint8:  # e2m1 has no NaN: a NaN block scale instead
        scale = codes.replace("_packed", "") + "_scale"
        tensors[scale] = tensors[scale].copy()
        tensors[scale].view(np.uint8)[0, 0] = 0x7F
    else:
        tensors[codes].view(np.uint8)[3, 3] = 0x7F
    quant_examples.st_write(str(folder / "model.safetensors"), {
        n: quant_examples.T({np.dtype(np.uint8): "U8", np.dtype(np.float32): "F32",
                             np.dtype(ml_dtypes.bfloat16): "BF16", np.dtype(ml_dtypes.float8_e4m3fn): "F8_E4M3"}[a.dtype],
                            a) for n, a in tensors.items()})
    result = run("global", "--clip", "1", "--nonfinite", "propagate", "-q", target(folder))
    assert result.exit_code == 0, result.output
    after = report_json(folder / "model.clipped.safetensors")
    quantized = [t for t in after["tensors"] if "quantization" in t]
    assert quantized and all(t["nonfinite"]["nan"] == math.prod(t["shape"]) for t in quantized)
