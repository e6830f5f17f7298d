"""The Python API (issue 32): ``tclip.open/report/summary/clip/diff`` across the formats, through
``import tclip`` alone; values against the writers' own readers, verdicts against the CLI's exit codes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import tracemalloc
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

import tclip
from support import gguf_examples
from support import quant_examples as qx

LAYER = "model.layers.17.self_attn.k_proj.weight"
RNG_SEED = 32


def _tensors() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(RNG_SEED)
    return {LAYER: rng.standard_normal((64, 32)).astype(np.float32),
            "model.layers.2.mlp.down_proj.weight": rng.standard_normal((16, 8)).astype(np.float32),
            "model.layers.10.mlp.down_proj.weight": rng.standard_normal((16, 8)).astype(np.float32),
            "model.norm.weight": (rng.standard_normal(32)).astype(ml_dtypes.bfloat16)}


def _st(path: Path, tensors: dict[str, np.ndarray]) -> Path:
    codes = {np.dtype(np.float32): "F32", np.dtype(ml_dtypes.bfloat16): "BF16", np.dtype(np.float64): "F64"}
    qx.st_write(str(path), {k: qx.T(codes[v.dtype], v) for k, v in tensors.items()})
    return path


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "tclip", *args], capture_output=True, text=True, timeout=300)


def _torch_save(path: Path, tensors: dict[str, np.ndarray]) -> None:
    arrays = path.with_name(path.name + ".arrays.npz")
    np.savez(arrays, **{k: v.astype(np.float32) for k, v in tensors.items()})
    script = ("import sys, numpy as np, torch\n"
              "a = np.load(sys.argv[1])\n"
              "torch.save({k: torch.from_numpy(a[k]) for k in a.files}, sys.argv[2])\n")
    subprocess.run([sys.executable, "-c", script, str(arrays), str(path)], check=True, timeout=300)
    arrays.unlink()


# --------------------------------------------------------------------------- open


def test_open_every_plain_format_gives_the_writers_values(tmp_path: Path) -> None:
    import h5py

    tensors = _tensors()
    floats = {k: v for k, v in tensors.items() if v.dtype == np.float32}
    np.save(tmp_path / "one.npy", tensors[LAYER])
    np.savez(tmp_path / "a.npz", **floats)
    _st(tmp_path / "a.safetensors", tensors)
    with h5py.File(tmp_path / "a.h5", "w") as f:
        for k, v in floats.items():
            f[k] = v
    _torch_save(tmp_path / "a.pt", floats)
    with tclip.open(tmp_path / "one.npy") as ck:
        (name,) = ck.names
        assert np.array_equal(ck[name], tensors[LAYER])
    for file, expected in (("a.npz", floats), ("a.safetensors", tensors), ("a.h5", floats), ("a.pt", floats)):
        with tclip.open(tmp_path / file) as ck:
            assert set(ck) == set(expected), file
            for k, v in expected.items():
                got = ck[k]
                assert got.dtype == v.dtype and got.shape == v.shape, (file, k)
                assert np.array_equal(got.view(np.uint8), v.view(np.uint8)), (file, k)  # bit-identical
                assert ck.info(k).shape == v.shape and ck.info(k).dtype == str(v.dtype)


def test_names_are_in_natural_order_and_an_unknown_name_is_a_key_error(tmp_path: Path) -> None:
    with tclip.open(_st(tmp_path / "a.safetensors", _tensors())) as ck:
        assert ck.names == ["model.layers.2.mlp.down_proj.weight", "model.layers.10.mlp.down_proj.weight",
                            LAYER, "model.norm.weight"]
        assert list(ck) == ck.names and len(ck) == 4 and LAYER in ck
        with pytest.raises(KeyError):
            ck["model.layers.0.mlp.up_proj.weight"]
        with pytest.raises(KeyError):
            ck.info("nope")


def test_open_a_set_through_its_index_and_its_folder(tmp_path: Path) -> None:
    tensors = _tensors()
    names = sorted(tensors)
    folder = tmp_path / "ckpt"
    folder.mkdir()
    _st(folder / "model-00001-of-00002.safetensors", {k: tensors[k] for k in names[:2]})
    _st(folder / "model-00002-of-00002.safetensors", {k: tensors[k] for k in names[2:]})
    weight_map = {k: "model-0000%d-of-00002.safetensors" % (1 if k in names[:2] else 2) for k in names}
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    for path in (folder, folder / "model.safetensors.index.json"):
        with tclip.open(path) as ck:
            assert sorted(ck) == names
            for k in names:
                assert np.array_equal(ck[k].view(np.uint8), tensors[k].view(np.uint8))
    rep = tclip.report(folder)
    exact = float(np.sqrt(sum(np.sum(v.astype(np.float64) ** 2) for v in tensors.values())))
    assert rep.global_norm == pytest.approx(exact, rel=1e-12)
    assert len(rep.tensors) == 4


def test_gguf_quantized_weights_equal_gguf_py_dequantize(tmp_path: Path) -> None:
    import gguf

    for kind, label in ((gguf_examples.Q8_0, "Q8_0"), (gguf_examples.Q4_0, "Q4_0")):
        path = tmp_path / f"m-{label}.gguf"
        gguf_examples.write(path, kind)
        stored = {t.name: t for t in gguf.GGUFReader(str(path)).tensors}
        with tclip.open(path) as ck:
            name = "blk.1.ffn_down.weight"
            got = ck[name]
            expected = gguf.quants.dequantize(np.asarray(stored[name].data), stored[name].tensor_type)
            assert got.dtype == np.float32 and got.shape == expected.shape
            assert np.array_equal(got, expected), label
            assert ck.info(name).quantized and ck.info(name).stored_dtype == label
            # the stored blocks stay reachable, as the file holds them
            raw = ck.stored(name)
            assert raw.dtype == np.uint8 and np.array_equal(raw, np.asarray(stored[name].data).reshape(-1))
            assert name in ck.stored_names
            counted = {t.name: t.norm for t in tclip.report(path).tensors}[name]  # report counts these values
            assert counted == pytest.approx(float(np.linalg.norm(got.astype(np.float64))), rel=1e-12)
            norm = np.asarray(ck["blk.0.attn_norm.weight"])
            assert np.array_equal(norm, np.asarray(stored["blk.0.attn_norm.weight"].data))


@pytest.mark.parametrize("convention", ["deepseek_fp8_block", "ct_nvfp4"])
def test_fp8_and_nvfp4_weights_come_back_dequantized(tmp_path: Path, convention: str) -> None:
    folders = qx.build(str(tmp_path), [convention])
    for key in (convention, convention + "_sharded"):
        real, roles, primary, where, conv = qx.dequant_dir(folders[key])
        with tclip.open(folders[key]) as ck:
            quantized = [n for n in ck.names if ck.info(n).quantized]
            assert quantized
            for name in quantized[:6]:
                got = ck[name]
                assert got.dtype == np.float32
                assert np.array_equal(got, real[name].astype(np.float32)), (key, name)
            assert any(n.endswith("_scale_inv") or n.endswith("scale") or "scale" in n for n in ck.stored_names)
            codes = ck.stored(primary[quantized[0]])
            assert codes.shape != () and codes.dtype != np.float32


def test_reading_one_tensor_does_not_read_the_file(tmp_path: Path) -> None:
    rng = np.random.default_rng(1)
    tensors = {f"model.layers.{i}.mlp.up_proj.weight": rng.standard_normal((1024, 1024)).astype(np.float32)
               for i in range(16)}  # 64 MiB
    tensors["model.layers.9.mlp.up_proj.weight"] = tensors["model.layers.9.mlp.up_proj.weight"][:256]  # 1 MiB
    path = _st(tmp_path / "big.safetensors", tensors)
    with tclip.open(path) as ck:
        tracemalloc.start()
        try:
            value = ck["model.layers.9.mlp.up_proj.weight"]
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        assert np.array_equal(value, tensors["model.layers.9.mlp.up_proj.weight"])
    assert peak < 4 * 2 ** 20, peak  # the tensor (1 MiB) and small change, not the file (64 MiB)


# --------------------------------------------------------------------------- report, verdicts


@pytest.mark.parametrize("max_norm, code", [(1e6, 0), (1.0, 3)])
def test_passed_is_the_cli_exit_code(tmp_path: Path, max_norm: float, code: int) -> None:
    path = _st(tmp_path / "g.safetensors", _tensors())
    rep = tclip.report(path, max_norm=max_norm)
    assert _cli("report", "-q", "--max-norm", str(max_norm), str(path)).returncode == code
    assert rep.passed is (code == 0)
    assert rep.verdict == ("passed" if code == 0 else "failed")
    assert rep.to_json()["verdict"] == rep.verdict


def test_nan_fails_the_gate_and_no_limit_checks_nothing(tmp_path: Path) -> None:
    tensors = _tensors()
    tensors[LAYER][3, 4] = np.nan
    path = _st(tmp_path / "g.safetensors", tensors)
    rep = tclip.report(path, max_norm=1e9)
    assert rep.passed is False and _cli("report", "-q", "--max-norm", "1e9", str(path)).returncode == 3
    (bad,) = [t for t in rep.tensors if t.nonfinite]
    assert bad.name == LAYER and bad.nan == 1
    unchecked = tclip.report(path)
    assert unchecked.passed is None and unchecked.verdict is None
    assert _cli("report", "-q", str(path)).returncode == 0


def test_report_records(tmp_path: Path) -> None:
    tensors = _tensors()
    path = _st(tmp_path / "g.safetensors", tensors)
    rep = tclip.report(path, axes=1, stats=True)
    by_name = {t.name: t for t in rep.tensors}
    assert by_name[LAYER].norm == pytest.approx(float(np.linalg.norm(tensors[LAYER].astype(np.float64))),
                                                rel=1e-13)
    assert by_name[LAYER].shape == (64, 32) and by_name[LAYER].dtype == "float32"
    assert by_name[LAYER].slices == 64
    records = rep.to_records()
    assert [r["name"] for r in records] == [t.name for t in rep.tensors]
    json.dumps(rep.to_json())
    json.dumps([t.to_json() for t in rep.tensors])


def test_to_pandas(tmp_path: Path) -> None:
    pytest.importorskip("pandas")
    path = _st(tmp_path / "g.safetensors", _tensors())
    frame = tclip.report(path).to_pandas()
    assert len(frame) == 4 and "norm" in frame.columns


def test_to_pandas_without_pandas_says_so(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "pandas", None)  # import pandas then raises ImportError
    rep = tclip.report(_st(tmp_path / "g.safetensors", _tensors()))
    with pytest.raises(ImportError, match="needs pandas"):
        rep.to_pandas()


def test_summary_one_row_per_file_in_step_order(tmp_path: Path) -> None:
    rng = np.random.default_rng(5)
    for step in (100, 20, 3):
        np.savez(tmp_path / f"step-{step}.npz", **{LAYER: rng.standard_normal((4, 4)).astype(np.float32) * step})
    s = tclip.summary(str(tmp_path / "step-*.npz"))
    rows = s.to_records()
    assert [Path(r["file"]).name for r in rows] == ["step-3.npz", "step-20.npz", "step-100.npz"]
    for row in rows:
        with tclip.open(row["file"]) as ck:
            assert row[LAYER] == pytest.approx(float(np.linalg.norm(ck[LAYER].astype(np.float64))), rel=1e-13)
    json.dumps(s.to_json())


# --------------------------------------------------------------------------- clip, diff


def test_clip_writes_and_names_what_it_clipped(tmp_path: Path) -> None:
    tensors = _tensors()
    path = _st(tmp_path / "g.safetensors", tensors)
    dry = tclip.clip(path, tclip.NormClip(5.0, axes=1), dry_run=True)
    assert dry.output is None and not (tmp_path / "g.clipped.safetensors").exists()
    res = tclip.clip(path, tclip.NormClip(5.0, axes=1))
    assert res.output == str(tmp_path / "g.clipped.safetensors") and res.clipped == dry.clipped
    expected = tclip.clip_by_norm(tensors[LAYER], 5.0, axes=1)
    with tclip.open(res.output) as ck:
        assert np.array_equal(ck[LAYER], expected)
    assert LAYER in res.clipped
    json.dumps(res.to_json())
    with pytest.raises(tclip.TclipError, match="g.clipped.safetensors"):
        tclip.clip(path, tclip.NormClip(5.0, axes=1))  # the output exists
    for _ in range(2):  # the second replaces the first
        tclip.clip(path, tclip.GlobalNormClip(1.0), output=tmp_path / "o.safetensors", overwrite=True)
    # (each value rounded to bfloat16/float32)
    assert tclip.report(tmp_path / "o.safetensors").global_norm == pytest.approx(1.0, rel=1e-4)


def test_diff_verdicts_match_the_cli(tmp_path: Path) -> None:
    tensors = _tensors()
    a = _st(tmp_path / "a.safetensors", tensors)
    b = _st(tmp_path / "b.safetensors", tensors)
    tensors[LAYER][0, 0] += 1
    c = _st(tmp_path / "c.safetensors", tensors)
    assert tclip.diff(a, b).verdict == "same" and _cli("diff", "-q", str(a), str(b)).returncode == 0
    d = tclip.diff(a, c)
    assert d.verdict == "differ" and _cli("diff", "-q", str(a), str(c)).returncode == 3
    assert [t.name for t in d.tensors if t.differs] == [LAYER]
    json.dumps(d.to_json())


# --------------------------------------------------------------------------- errors, namespace


def test_errors_are_tclip_errors_naming_the_file(tmp_path: Path) -> None:
    bad = tmp_path / "broken.safetensors"
    bad.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json")
    for call in (lambda: tclip.open(bad), lambda: tclip.report(bad), lambda: tclip.diff(bad, bad),
                 lambda: tclip.clip(bad, tclip.ValueClip(-1, 1)), lambda: tclip.report(tmp_path / "none.npz")):
        with pytest.raises(tclip.TclipError) as error:
            call()
        assert str(tmp_path) in str(error.value)


def test_namespace_holds_the_api_not_the_helpers() -> None:
    for name in ("open", "report", "summary", "clip", "diff", "TclipError", "NormClip", "GlobalNormClip",
                 "ValueClip", "AverageNormClip", "clip_by_norm", "clip_by_global_norm", "global_norm"):
        assert name in dir(tclip) and getattr(tclip, name) is not None
    assert callable(tclip.diff)
    for name in ("stats_axes", "scale_for_piece", "apply_scale", "plan_scales", "TensorStats", "normalize_axes",
                 "clip_file", "report_file", "file_info", "diff_files"):
        assert not hasattr(tclip, name), name


def test_old_module_paths_warn() -> None:
    for module in ("tclip.pipeline", "tclip.tensorset"):
        code = f"import warnings; warnings.simplefilter('error'); import {module}"
        result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
        assert result.returncode != 0 and "DeprecationWarning" in result.stderr, module


def test_the_api_imports_no_cli() -> None:
    code = textwrap.dedent("""
        import sys, tempfile, os, numpy as np, tclip
        path = os.path.join(tempfile.mkdtemp(), "a.npz")
        np.savez(path, w=np.ones(3, np.float32))
        with tclip.open(path) as ck:
            ck["w"]
        tclip.report(path, max_norm=1.0), tclip.diff(path, path), tclip.summary(path)
        tclip.clip(path, tclip.NormClip(1.0), dry_run=True)
        assert not [m for m in sys.modules if m.split('.')[0] in ('click', 'rich')], 'cli imported'
        assert 'torch' not in sys.modules
    """)
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_a_gguf_split_set_opens_as_one_checkpoint(tmp_path: Path) -> None:
    import gguf
    from support import gguf_helpers as gh

    rng = np.random.default_rng(3)
    folder = tmp_path / "model"
    folder.mkdir()
    made = {}
    for number in range(2):
        name = f"blk.{number}.ffn_down.weight"
        raw = gguf.quants.quantize(rng.standard_normal((8, 64)).astype(np.float32), gguf.GGMLQuantizationType.Q8_0)
        made[name] = raw
        meta = [("split.no", gh.UINT16, number), ("split.count", gh.UINT16, 2), ("split.tensors.count", gh.INT32, 2)]
        tensor = gh.Tensor(name, (8, 64), gh.TYPE_IDS["Q8_0"], raw.tobytes())
        gh.write_gguf(folder / f"m-{number + 1:05d}-of-00002.gguf", gh.GgufSpec(metadata=meta, tensors=[tensor]))
    for given in (folder, folder / "m-00002-of-00002.gguf"):
        with tclip.open(given) as ck:
            assert ck.names == sorted(made)
            for name, raw in made.items():
                assert np.array_equal(ck[name], gguf.quants.dequantize(raw, gguf.GGMLQuantizationType.Q8_0))


def test_a_dcp_folder_opens_as_torch_saved_it(tmp_path: Path) -> None:
    from support import dcp_helpers

    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    subprocess.run([sys.executable, str(dcp_helpers.HERE), str(tmp_path), "single"], check=True, env=env,
                   timeout=600, capture_output=True)
    folder, arrays, meta = dcp_helpers.expected(tmp_path, "single")
    with tclip.open(folder) as ck:
        assert set(ck) == set(meta["tensors"])
        for name in ck:
            assert ck[name].tobytes() == arrays[name].tobytes(), name
            assert list(ck.info(name).shape) == meta["tensors"][name]["shape"]
