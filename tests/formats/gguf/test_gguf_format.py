"""GGUF files as a format (issue 18): the reader, exact statistics of quantized blocks, the gate
on their scales, clipping by rewriting scales only, hostile files at the command line.

Files are written by tests/support/gguf_helpers.py (from the spec, either byte order); reference
values come from the ``gguf`` package's own dequantization (llama.cpp's Python code),
summed with ``math.fsum``.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

from support import gguf_helpers as gh
from support.cli import run80 as run
from support.gguf_helpers import blocks_for, split_set
import tclip

from tclip.formats import open_reader
from tclip.formats.gguf.header import parse_gguf
from tclip.quant import ggml as gb

gguf = pytest.importorskip("gguf")

QUANTIZED = ["Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K"]
FLOATS = ["F32", "F16", "BF16"]
ROWS, COLS = 6, 512
NAMES = {t: f"blk.{i}.attn_{'qkv'[i % 3]}.weight" for i, t in enumerate(QUANTIZED + FLOATS)}


def ok(*args):
    result = run(*args)
    assert result.exit_code == 0, result.output + result.stderr
    return result


def reference(type_name: str, raw: bytes, rows: int, order: str = "<") -> np.ndarray:
    """float64 values from the gguf package (little-endian blocks only)."""
    type_id = gh.TYPE_IDS[type_name]
    if order == ">":
        raw = gh.swap_block_fields(raw, type_id)  # swapping twice gives the little-endian bytes back
    data = np.frombuffer(raw, np.uint8).reshape(rows, -1)
    with np.errstate(invalid="ignore", over="ignore"):
        if type_name == "BF16":
            values = (data.reshape(-1).view("<u2").astype(np.uint32) << 16).view(np.float32)
        else:
            values = gguf.quants.dequantize(data, gguf.GGMLQuantizationType(type_id))
    return np.asarray(values, np.float64).reshape(rows, -1)


def model(path: Path, types=QUANTIZED + FLOATS, order: str = "<", seed: int = 0, rows: int = ROWS,
          cols: int = COLS, metadata=None) -> dict[str, tuple[str, bytes]]:
    """A GGUF file of one ``rows x cols`` tensor of each type; returns name: (type, bytes)."""
    rng = np.random.default_rng(seed)
    tensors, made = [], {}
    for type_name in types:
        raw = blocks_for(type_name, rows, cols, rng, order)
        tensors.append(gh.Tensor(NAMES[type_name], (rows, cols), gh.TYPE_IDS[type_name], raw))
        made[NAMES[type_name]] = (type_name, raw)
    meta = [("general.architecture", gh.STRING, "llama"), ("llama.block_count", gh.UINT32, 32)]
    gh.write_gguf(path, gh.GgufSpec(metadata=meta + list(metadata or []), tensors=tensors, order=order))
    return made


def report_json(*args) -> dict:
    result = run("report", "--json", *args)
    assert result.exit_code in (0, 3), result.output + result.stderr
    return json.loads(result.stdout.splitlines()[0])


def fsum_norm(values: np.ndarray) -> float:
    return math.sqrt(math.fsum((values.reshape(-1) ** 2).tolist()))


# ----------------------------------------------------------------------------- 18.1 the reader


def test_info_lists_gguf_names_ggml_types_and_summarised_metadata(tmp_path):
    vocab = gh.Array(gh.STRING, [f"tok{i}" for i in range(5000)])
    model(tmp_path / "m.gguf", metadata=[("tokenizer.ggml.tokens", gh.ARRAY, vocab)])
    out = ok("info", tmp_path / "m.gguf").stdout
    assert "blk.7.attn_k.weight" in out and "Q4_K" in out and "6×512" in out
    assert '"length": 5000' in out and "tok7" in out and "tok8" not in out  # the first few, never all
    data = json.loads(ok("info", "--json", tmp_path / "m.gguf").stdout.splitlines()[0])
    tensors = {t["name"]: t for t in data["tensors"]}
    assert tensors["blk.9.attn_q.weight"]["shape"] == [ROWS, COLS]  # NumPy order: rows, then ne0


def test_unknown_and_unsupported_types_are_listed_never_a_crash(tmp_path):
    path = tmp_path / "odd.gguf"
    gh.write_gguf(path, gh.GgufSpec(tensors=[
        gh.Tensor("token_embd.weight", (2, 256), 0, bytes(2048)),
        gh.Tensor("blk.0.ffn_down.weight", (1, 256), 16, bytes(66)),  # IQ2_XXS
        gh.Tensor("blk.0.mystery", (4,), 99, b"", offset=2048 + 96)]))
    with open(path, "ab") as handle:
        handle.write(bytes(64))
    out = ok("info", path).stdout
    assert "IQ2_XXS" in out and "unknown ggml type 99" in out
    data = report_json(path)
    skipped = {t["name"]: t["skipped"] for t in data["tensors"] if t["skipped"]}
    assert "IQ2_XXS is not supported" in skipped["blk.0.ffn_down.weight"]


def test_big_endian_file_reads_like_little_endian(tmp_path):
    little = model(tmp_path / "le.gguf")
    model(tmp_path / "be.gguf", order=">")
    a = {t["name"]: t for t in report_json(tmp_path / "le.gguf")["tensors"]}
    b = {t["name"]: t for t in report_json(tmp_path / "be.gguf")["tensors"]}
    for name in little:
        assert a[name]["norm"] == b[name]["norm"] and a[name]["max_abs"] == b[name]["max_abs"], name


# ----------------------------------------------------------------------------- 18.2 exact statistics


@pytest.mark.parametrize("order", ["<", ">"])
def test_norms_are_those_of_the_dequantized_values(tmp_path, order):
    made = model(tmp_path / "m.gguf", order=order)
    tensors = {t["name"]: t for t in report_json(tmp_path / "m.gguf")["tensors"]}
    for name, (type_name, raw) in made.items():
        values = reference(type_name, raw, ROWS, order)
        assert tensors[name]["norm"] == pytest.approx(fsum_norm(values), rel=1e-15, abs=0), type_name
        assert tensors[name]["max_abs"] == np.abs(values).max(), type_name


def test_axes_rows_and_other_axes_and_stats(tmp_path):
    made = model(tmp_path / "m.gguf", types=["Q4_K", "Q8_0", "Q6_K"])
    per_row = {t["name"]: t for t in report_json("--axes", 1, tmp_path / "m.gguf")["tensors"]}
    per_column = {t["name"]: t for t in report_json("--axes", 0, tmp_path / "m.gguf")["tensors"]}
    stats = {t["name"]: t for t in report_json("--stats", tmp_path / "m.gguf")["tensors"]}
    for name, (type_name, raw) in made.items():
        values = reference(type_name, raw, ROWS)
        rows = [fsum_norm(r) for r in values]
        columns = [fsum_norm(c) for c in values.T]
        assert per_row[name]["max_slice_norm"] == pytest.approx(max(rows), rel=1e-15)
        assert per_column[name]["max_slice_norm"] == pytest.approx(max(columns), rel=1e-14)
        assert stats[name]["mean"] == pytest.approx(math.fsum(values.reshape(-1).tolist()) / values.size, rel=1e-12)
        assert stats[name]["min"] == values.min() and stats[name]["max"] == values.max()


# ----------------------------------------------------------------------------- 18.3 the gate


def nan_scale_file(path: Path) -> None:
    rng = np.random.default_rng(3)
    q8 = bytearray(blocks_for("Q8_0", ROWS, COLS, rng))
    q8[34 * 21:34 * 21 + 2] = np.array([np.nan], "<f2").tobytes()  # row 1, block 5 (16 blocks a row)
    q4k = bytearray(blocks_for("Q4_K", ROWS, COLS, rng))
    q4k[144 * 3 + 2:144 * 3 + 4] = np.array([np.inf], "<f2").tobytes()  # dmin of row 1, block 1
    gh.write_gguf(path, gh.GgufSpec(tensors=[
        gh.Tensor("blk.17.attn_k.weight", (ROWS, COLS), 8, bytes(q8)),
        gh.Tensor("blk.17.ffn_up.weight", (ROWS, COLS), 12, bytes(q4k)),
        gh.Tensor("output_norm.weight", (COLS,), 0, np.ones(COLS, "<f4").tobytes())]))


def test_nan_and_inf_scales_fail_the_gate_naming_tensor_and_block(tmp_path):
    nan_scale_file(tmp_path / "bad.gguf")
    result = run("report", "--max-norm", 1e9, tmp_path / "bad.gguf")
    assert result.exit_code == 3
    assert "blk.17.attn_k.weight (32 NaN: NaN scale in blk.17.attn_k.weight d block [1, 5])" in result.stderr
    assert "Inf scale in blk.17.ffn_up.weight dmin block [1, 1]" in result.stderr


def test_report_always_shows_nan_scales(tmp_path):
    nan_scale_file(tmp_path / "bad.gguf")
    result = run("report", tmp_path / "bad.gguf")
    assert result.exit_code == 0
    assert "blk.17.attn_k.weight: NaN scale in blk.17.attn_k.weight d block [1, 5]" in result.stderr
    data = report_json(tmp_path / "bad.gguf")
    scales = {t["name"]: t["quantization"]["scales"] for t in data["tensors"] if t.get("quantization")}
    assert [(s["name"], s["nan"], s["inf"], s["count"]) for s in scales["blk.17.ffn_up.weight"]] == [
        ("blk.17.ffn_up.weight d", 0, 0, ROWS * 2), ("blk.17.ffn_up.weight dmin", 0, 1, ROWS * 2)]


def test_a_tensor_cut_short_is_an_error_naming_it(tmp_path):
    path = tmp_path / "cut.gguf"
    model(path, types=["F16", "Q4_K"])
    path.write_bytes(path.read_bytes()[:-100])
    result = run("report", path)
    assert result.exit_code == 1
    assert result.stderr.startswith("Error: ") and "'blk.7.attn_k.weight'" in result.stderr
    assert "runs past the end of the file" in result.stderr and len(result.stderr.splitlines()) == 1


# ----------------------------------------------------------------------------- 18.4 clipping


def scale_field_mask(type_name: str, nbytes: int) -> np.ndarray:
    """True at the bytes of every block's f16 d/dmin/m."""
    elements, block_bytes, fields = gh.BLOCKS[gh.TYPE_IDS[type_name]]
    mask = np.zeros((nbytes // block_bytes, block_bytes), bool)
    for at in fields:
        mask[:, at:at + 2] = True
    return mask.reshape(-1)


def data_of(path: Path, name: str) -> bytes:
    tensor = parse_gguf(path).tensor(name)
    with open(path, "rb") as handle:
        handle.seek(tensor.offset)
        return handle.read(tensor.nbytes)


@pytest.mark.parametrize("order", ["<", ">"])
def test_norm_clip_rewrites_only_scale_fields(tmp_path, order):
    made = model(tmp_path / "m.gguf", order=order)
    source = tmp_path / "m.gguf"
    before = source.read_bytes()
    ok("norm", "--clip", 2.0, source)
    out = tmp_path / "m.clipped.gguf"
    header = parse_gguf(source)
    assert out.stat().st_size == source.stat().st_size
    assert out.read_bytes()[:header.data_offset] == before[:header.data_offset]  # metadata and layout
    assert source.read_bytes() == before
    after = {t["name"]: t for t in report_json(out)["tensors"]}
    for name, (type_name, raw) in made.items():
        new = data_of(out, name)
        if type_name in FLOATS:
            values = reference(type_name, raw, ROWS, order) if type_name == "BF16" else None
            dtype = {"F32": "f4", "F16": "f2"}.get(type_name)
            old = np.frombuffer(raw, order + dtype) if dtype else values.reshape(-1).astype(ml_dtypes.bfloat16)
            expected = tclip.clip_by_norm(old, 2.0)
            got = np.frombuffer(new, order + dtype) if dtype else reference("BF16", new, ROWS, order)
            assert np.array_equal(np.asarray(got, np.float64).reshape(-1),
                                  np.asarray(expected, np.float64).reshape(-1)), type_name
            continue
        mask = scale_field_mask(type_name, len(raw))
        assert np.array_equal(np.frombuffer(new, np.uint8)[~mask], np.frombuffer(raw, np.uint8)[~mask]), type_name
        norm_before = fsum_norm(reference(type_name, raw, ROWS, order))
        norm_after = fsum_norm(reference(type_name, new, ROWS, order))
        assert after[name]["norm"] == pytest.approx(norm_after, rel=1e-15)
        if norm_before > 2.0:
            assert norm_after == pytest.approx(2.0, rel=2.0 ** -9), type_name
            # every value is factor * value up to the f16 rounding of its block's scales
        else:
            assert new == raw


def test_scales_are_the_exact_products_rounded_once(tmp_path):
    made = model(tmp_path / "m.gguf", types=["Q8_0", "Q4_K"])
    ok("global", "--clip", 0.5, tmp_path / "m.gguf")
    norms = {n: fsum_norm(reference(t, raw, ROWS)) for n, (t, raw) in made.items()}
    factor = 0.5 / math.sqrt(math.fsum(n * n for n in norms.values()))
    for name, (type_name, raw) in made.items():
        expected = gb.scale_blocks(gh.TYPE_IDS[type_name], raw, factor).data.tobytes()
        assert data_of(tmp_path / "m.clipped.gguf", name) == expected


def test_global_clip_output_passes_the_gate_and_per_row_clip(tmp_path):
    model(tmp_path / "m.gguf")
    limit = report_json(tmp_path / "m.gguf")["global_norm"] / 3
    ok("global", "--clip", limit, tmp_path / "m.gguf")
    assert run("report", "--max-norm", limit, tmp_path / "m.clipped.gguf").exit_code == 0
    ok("norm", "--clip", 0.8, "--axes", 1, tmp_path / "m.gguf", "-o", tmp_path / "rows.gguf")
    result = run("report", "--axes", 1, "--max-norm", 0.8, tmp_path / "rows.gguf")
    assert result.exit_code == 0, result.stderr
    for t in report_json("--axes", 1, tmp_path / "rows.gguf")["tensors"]:
        assert t["max_slice_norm"] <= 0.8 * (1 + 2.0 ** -9), t["name"]


def test_a_factor_whose_subnormal_scales_miss_the_norm_is_refused(tmp_path):
    model(tmp_path / "m.gguf", types=["F32", "Q8_0"])
    for extra, where in (((), "its norm"), (("--axes", 1), "its row 0 norm")):
        result = run("norm", "--clip", 0.001, *extra, tmp_path / "m.gguf")
        assert result.exit_code == 1
        assert f"tensor 'blk.0.attn_q.weight' (Q8_0): rewriting its float16 block scales by " in result.stderr
        assert f"leaves {where} at " in result.stderr and "more than 2**-9 off" in result.stderr
        assert "nothing was written" in result.stderr and len(result.stderr.splitlines()) == 1
        assert not (tmp_path / "m.clipped.gguf").exists()


def test_real_q6_k_scales_among_the_subnormals_are_still_clipped(tmp_path):
    """A Q6_K d is about 2e-5, already subnormal in f16: halving it rounds single blocks by
    up to 2**-7, but the tensor's norm lands within 2**-9 and passes the gate."""
    rng = np.random.default_rng(6)
    raw = gh.random_blocks(14, 64 * 4096 // 256, rng, d=2.4e-5)
    gh.write_gguf(tmp_path / "q6.gguf", gh.GgufSpec(tensors=[gh.Tensor("output.weight", (64, 4096), 14, raw)]))
    norm = fsum_norm(reference("Q6_K", raw, 64))
    ok("norm", "--clip", norm / 2, tmp_path / "q6.gguf")
    after = fsum_norm(reference("Q6_K", data_of(tmp_path / "q6.clipped.gguf", "output.weight"), 64))
    assert after == pytest.approx(norm / 2, rel=2.0 ** -9)
    assert run("report", "--max-norm", norm / 2, tmp_path / "q6.clipped.gguf").exit_code == 0


def test_value_clipping_and_unsupported_types_are_refused(tmp_path):
    model(tmp_path / "m.gguf", types=["Q4_K", "F32"])
    result = run("value", "--min", -0.01, "--max", 0.01, tmp_path / "m.gguf")
    assert result.exit_code == 1 and "requantiz" in result.stderr
    assert not (tmp_path / "m.clipped.gguf").exists()
    gh.write_gguf(tmp_path / "iq.gguf", gh.GgufSpec(tensors=[
        gh.Tensor("token_embd.weight", (2, 256), 0, np.ones(512, "<f4").tobytes()),
        gh.Tensor("blk.0.ffn_down.weight", (1, 256), 16, bytes(66))]))
    result = run("norm", "--clip", 1, tmp_path / "iq.gguf")
    assert result.exit_code == 1 and "IQ2_XXS is not supported" in result.stderr
    assert not (tmp_path / "iq.clipped.gguf").exists()
    ok("norm", "--clip", 1, "--exclude", "blk.0.ffn_down.weight", tmp_path / "iq.gguf")
    assert data_of(tmp_path / "iq.clipped.gguf", "blk.0.ffn_down.weight") == bytes(66)


def test_conversion_of_quantized_tensors_is_refused(tmp_path):
    model(tmp_path / "m.gguf", types=["Q8_0", "F32"])
    result = run("norm", "--clip", 1, tmp_path / "m.gguf", "-o", tmp_path / "m.safetensors")
    assert result.exit_code == 1 and "blk.0.attn_q.weight (Q8_0 blocks)" in result.stderr
    assert not (tmp_path / "m.safetensors").exists()
    ok("norm", "--clip", 1, "--drop-nonnumeric", tmp_path / "m.gguf", "-o", tmp_path / "m.safetensors")
    with open_reader(tmp_path / "m.safetensors") as reader:
        assert list(reader.tensors) == [NAMES["F32"]]  # the blocks are dropped, never written as float16


# ----------------------------------------------------------------------------- 18.7 hostile files


HOSTILE = {
    "bad magic": lambda: gh.gguf_bytes(gh.GgufSpec(magic=b"GGML")),
    "truncated header": lambda: gh.gguf_bytes(gh.GgufSpec(metadata=[("general.name", gh.STRING, "x" * 50)]))[:40],
    "string past EOF": lambda: b"GGUF" + (3).to_bytes(4, "little") + (0).to_bytes(8, "little")
    + (1).to_bytes(8, "little") + gh.string("k") + (8).to_bytes(4, "little") + (10**12).to_bytes(8, "little"),
    "tensor count past EOF": lambda: gh.gguf_bytes(gh.GgufSpec(tensor_count=10**12)),
    "data past EOF": lambda: gh.gguf_bytes(gh.GgufSpec(tensors=[
        gh.Tensor("blk.0.attn_q.weight", (2, 256), 12, bytes(288))]))[:-1],
    "overlapping data": lambda: gh.gguf_bytes(gh.GgufSpec(tensors=[
        gh.Tensor("a", (16,), 0, bytes(64), offset=0), gh.Tensor("b", (16,), 0, bytes(64), offset=32)])),
    "absurd dims": lambda: gh.gguf_bytes(gh.GgufSpec(tensors=[gh.Tensor("t", (1,), 0, bytes(4), n_dims=2**31)])),
    "unknown value type": lambda: b"GGUF" + (3).to_bytes(4, "little") + (0).to_bytes(8, "little")
    + (1).to_bytes(8, "little") + gh.string("k") + (13).to_bytes(4, "little") + bytes(16),
}


@pytest.mark.parametrize("command", [("info",), ("report",), ("report", "--max-norm", "1"), ("norm", "--clip", "1"),
                                     ("global", "--clip", "1"), ("diff", "GOOD")])
@pytest.mark.parametrize("case", list(HOSTILE))
def test_hostile_gguf_is_one_error_line_and_writes_nothing(tmp_path, case, command):
    path = tmp_path / "model-q4_k_m.gguf"
    path.write_bytes(HOSTILE[case]())
    model(tmp_path / "good.gguf", types=["F32"])
    args = [str(tmp_path / "good.gguf") if a == "GOOD" else a for a in command]
    before = sorted(os.listdir(tmp_path))
    result = run(*args, path)
    lines = result.stderr.splitlines()
    if case == "data past EOF" and command == ("info",):  # info reads the header only: listed, with a warning
        assert result.exit_code == 0 and len(lines) == 1 and lines[0].startswith("Warning: "), result.output
        assert "truncated" in lines[0] and sorted(os.listdir(tmp_path)) == before
        return
    assert result.exit_code == 1, result.output
    assert len(lines) == 1 and lines[0].startswith("Error: ") and "model-q4_k_m.gguf" in lines[0], lines
    assert sorted(os.listdir(tmp_path)) == before


def test_reader_lists_types_through_the_registry(tmp_path):
    model(tmp_path / "m.gguf", types=["Q5_K", "BF16"])
    with open_reader(tmp_path / "m.gguf") as reader:
        assert reader.format_name == "gguf"
        assert reader.tensors[NAMES["Q5_K"]].encoding.summary.scheme == "Q5_K"
        assert reader.tensors[NAMES["BF16"]].dtype == np.dtype(ml_dtypes.bfloat16)


# ----------------------------------------------------------------------------- 18.6 diff


def quantized_pair(tmp_path: Path) -> dict[str, np.ndarray]:
    """The same weights as F16 and as Q8_0/Q4_0 (quantized by the gguf package)."""
    rng = np.random.default_rng(11)
    weights = {f"blk.{i}.attn_q.weight": (rng.standard_normal((16, 512)) * 0.02).astype(np.float32)
               for i in range(3)}
    for kind, name in ((1, "model-f16.gguf"), (8, "model-q8_0.gguf"), (2, "model-q4_0.gguf")):
        tensors = [gh.Tensor(n, w.shape, kind, w.astype("<f2").tobytes() if kind == 1 else
                             gguf.quants.quantize(w, gguf.GGMLQuantizationType(kind)).tobytes())
                   for n, w in weights.items()]
        gh.write_gguf(tmp_path / name, gh.GgufSpec(tensors=tensors))
    return weights


@pytest.mark.parametrize("level", ["q8_0", "q4_0"])
def test_diff_of_two_quantization_levels_is_of_the_dequantized_values(tmp_path, level):
    weights = quantized_pair(tmp_path)
    result = run("diff", "--json", tmp_path / "model-f16.gguf", tmp_path / f"model-{level}.gguf")
    assert result.exit_code == 3
    data = json.loads(result.stdout.splitlines()[0])
    sizes = (tmp_path / "model-f16.gguf").stat().st_size + (tmp_path / f"model-{level}.gguf").stat().st_size
    assert data["bytes_read"] <= sizes  # the blocks read, not the float64 values compared
    kind = gh.TYPE_IDS[level.upper()]
    for t in data["tensors"]:
        assert (t["dtype_a"], t["dtype_b"]) == ("float16", level.upper())  # the type, not the scales' float16
        assert t["note"] == f"dtypes differ (float16 vs {level.upper()}): compared as values"
        a = weights[t["name"]].astype(np.float16).astype(np.float64)
        with open_reader(tmp_path / f"model-{level}.gguf") as reader:
            raw = reader.read_part(t["name"], 0, reader.tensors[t["name"]].nbytes).tobytes()
        b = gb.dequantize(kind, raw).astype(np.float64).reshape(a.shape)
        assert t["diff_norm"] == pytest.approx(fsum_norm(a - b), rel=1e-12)
        assert t["max_abs_diff"] == np.abs(a - b).max()
        assert t["cosine"] == pytest.approx(math.fsum((a * b).reshape(-1).tolist()) / (fsum_norm(a) * fsum_norm(b)),
                                            rel=1e-12)


def test_diff_gguf_against_safetensors_with_map(tmp_path):
    from safetensors.numpy import save_file

    weights = quantized_pair(tmp_path)
    save_file({n.replace("blk.", "model.layers.").replace("attn_q", "self_attn.q_proj"): w.astype(np.float16)
               for n, w in weights.items()}, str(tmp_path / "model.safetensors"))
    result = run("diff", "--map", "blk.*.attn_q.weight=model.layers.*.self_attn.q_proj.weight",
                 tmp_path / "model-f16.gguf", tmp_path / "model.safetensors")
    assert result.exit_code == 0, result.output
    assert "3 compared" in result.stdout


# ----------------------------------------------------------------------------- 18.5 split sets


@pytest.mark.parametrize("given", ["llama-3-8b-Q4_K_M-00002-of-00003.gguf", "llama-3-8b-Q4_K_M-*.gguf", "."])
def test_any_split_file_a_glob_or_the_folder_stands_for_the_set(tmp_path, given, monkeypatch):
    made = split_set(tmp_path / "model")
    monkeypatch.chdir(tmp_path / "model")
    data = [json.loads(line) for line in run("report", "--json", given).stdout.splitlines()]
    assert len(data) == 1  # one set, once
    norms = {t["name"]: t["norm"] for t in data[0]["tensors"]}
    assert sorted(norms) == sorted(made)
    expected = math.sqrt(math.fsum((reference(k, raw, ROWS) ** 2).sum() for k, raw in made.values()))
    assert data[0]["global_norm"] == pytest.approx(expected, rel=1e-14)


def test_global_clip_of_a_split_set_is_one_norm_keeping_names(tmp_path):
    made = split_set(tmp_path / "model")
    first = tmp_path / "model" / "llama-3-8b-Q4_K_M-00001-of-00003.gguf"
    limit = report_json(first)["global_norm"] / 2
    result = run("global", "--clip", limit, first)
    assert result.exit_code == 1 and "a split GGUF set needs --out-dir DIR" in result.stderr
    result = run("global", "--clip", limit, "--in-place", first)
    assert result.exit_code == 1 and "is clipped into --out-dir DIR, not --in-place" in result.stderr
    ok("global", "--clip", limit, first, "--out-dir", tmp_path / "clipped")
    assert sorted(p.name for p in (tmp_path / "clipped").iterdir()) == sorted(
        p.name for p in (tmp_path / "model").iterdir())
    data = report_json(tmp_path / "clipped" / "llama-3-8b-Q4_K_M-00003-of-00003.gguf")
    assert data["global_norm"] == pytest.approx(limit, rel=2.0 ** -9)
    assert run("report", "--max-norm", limit, tmp_path / "clipped" / first.name).exit_code == 0
    for file in (tmp_path / "clipped").iterdir():  # every file's header is its input's
        header = parse_gguf(file)
        assert file.read_bytes()[:header.data_offset] == (tmp_path / "model" / file.name).read_bytes()[
            :header.data_offset]


def test_a_split_set_with_a_missing_or_mislabelled_file_is_one_error(tmp_path):
    split_set(tmp_path / "model")
    (tmp_path / "model" / "llama-3-8b-Q4_K_M-00003-of-00003.gguf").unlink()
    result = run("report", tmp_path / "model" / "llama-3-8b-Q4_K_M-00001-of-00003.gguf")
    assert result.exit_code == 1 and "split 3 of 3 (llama-3-8b-Q4_K_M-00003-of-00003.gguf) is missing" in result.stderr
    split_set(tmp_path / "other", prefix="m")
    (tmp_path / "other" / "m-00002-of-00003.gguf").rename(tmp_path / "other" / "renamed.gguf")
    (tmp_path / "other" / "m-00003-of-00003.gguf").rename(tmp_path / "other" / "m-00002-of-00003.gguf")
    result = run("report", tmp_path / "other" / "m-00001-of-00003.gguf")
    assert result.exit_code == 1 and "not split 2 of 3" in result.stderr


def test_expert_stacks_vectors_and_empty_tensors(tmp_path):
    rng = np.random.default_rng(8)
    experts = gh.random_blocks(8, 8 * 4 * 512 // 32, rng, d=1e-3)
    vector = gh.random_blocks(12, 1, rng, d=1e-4, dmin=4e-4)
    path = tmp_path / "moe.gguf"
    gh.write_gguf(path, gh.GgufSpec(tensors=[gh.Tensor("blk.0.ffn_down_exps.weight", (8, 4, 512), 8, experts),
                                             gh.Tensor("blk.0.attn_norm.weight", (256,), 12, vector),
                                             gh.Tensor("blk.0.empty.weight", (0, 256), 12, b"")]))
    rows = reference("Q8_0", experts, 32).reshape(8, 4, 512)
    data = {t["name"]: t for t in report_json("--axes", -1, path)["tensors"]}
    assert data["blk.0.ffn_down_exps.weight"]["max_slice_norm"] == pytest.approx(
        max(fsum_norm(r) for r in rows.reshape(32, 512)), rel=1e-15)
    assert data["blk.0.empty.weight"]["norm"] == 0.0
    ok("norm", "--clip", 1.2, "--axes", -1, path, "-o", tmp_path / "out.gguf")
    assert run("report", "--axes", -1, "--max-norm", 1.2, tmp_path / "out.gguf").exit_code == 0
    clipped = reference("Q8_0", data_of(tmp_path / "out.gguf", "blk.0.ffn_down_exps.weight"), 32)
    for before, after in zip(rows.reshape(32, 512), clipped):  # each expert row its own factor
        target = min(fsum_norm(before), 1.2)
        assert fsum_norm(after) == pytest.approx(target, rel=2.0 ** -9)


def test_zero_d_is_a_dead_block_only_without_a_minimum(tmp_path):
    rng = np.random.default_rng(4)
    q8 = bytearray(blocks_for("Q8_0", ROWS, COLS, rng))
    q8[34 * 17:34 * 17 + 2] = bytes(2)  # row 1, block 1: every value 0
    q4k = bytearray(blocks_for("Q4_K", ROWS, COLS, rng))
    q4k[144 * 4 + 2:144 * 4 + 4] = bytes(2)  # a zero dmin: an ordinary block
    tensors = [gh.Tensor("blk.3.attn_v.weight", (ROWS, COLS), 8, bytes(q8)),
               gh.Tensor("blk.3.ffn_up.weight", (ROWS, COLS), 12, bytes(q4k))]
    gh.write_gguf(tmp_path / "z.gguf", gh.GgufSpec(tensors=tensors))
    result = run("report", tmp_path / "z.gguf")
    assert result.exit_code == 0
    assert result.stderr.splitlines() == [f"Warning: {tmp_path / 'z.gguf'}: blk.3.attn_v.weight: 1 zero scale(s) in "
                                          "blk.3.attn_v.weight d (dead blocks: their values are all 0), first at block "
                                          "[1, 1]"]
    scales = {t["name"]: t["quantization"]["scales"] for t in report_json(tmp_path / "z.gguf")["tensors"]}
    d, dmin = scales["blk.3.ffn_up.weight"]
    assert (d["zero"], dmin["zero"], dmin["smallest"] > 0) == (0, 0, True)
