"""A format is one module plus registration: the registry, a toy format through the CLI, lazy h5py."""

from __future__ import annotations

import inspect
import math
import json
import subprocess
import sys

import numpy as np
import pytest

from support import toy_format
from support.cli import run
import tclip
from tclip.formats import registry

RNG = np.random.default_rng(7)


@pytest.fixture
def toy():
    registry.register(toy_format)
    yield toy_format
    registry.unregister(toy_format)


def test_every_format_module_exports_the_protocol_and_one_writer_signature():
    signatures = set()
    for module in registry.FORMATS:
        for name in ("NAME", "SUFFIXES", "sniff", "Reader", "Writer"):
            assert hasattr(module, name), (module.__name__, name)
        parameters = inspect.signature(module.Writer).parameters
        signatures.add(tuple((p.name, p.kind) for p in parameters.values()))
        assert not any(p.kind is p.VAR_KEYWORD for p in parameters.values()), module.__name__
    assert len(signatures) == 1


def test_a_module_without_the_protocol_is_not_registered():
    with pytest.raises(ValueError, match="lacks"):
        registry.register(json)


def test_the_suffixes_come_from_the_registry(tmp_path, toy):
    assert registry.suffixes()[".toy"] == "toy"
    result = run("norm", "--clip", "1", "-o", tmp_path / "x.txt", tmp_path / "a.npy")
    assert result.exit_code == 2
    assert "the suffix must be .npy, .npz, .safetensors, .h5, .hdf5, .pt, .pth, .bin, .gguf or .toy" in result.stderr


def test_info_report_and_norm_on_a_toy_format(tmp_path, toy):
    w = (RNG.standard_normal((30, 20)) * 3).astype(np.float32)
    b = RNG.standard_normal(20).astype(np.float32)
    steps = np.arange(4, dtype=np.int8)
    toy.write(tmp_path / "g.toy", {"w": w, "b": b, "steps": steps})

    info = run("info", "--json", tmp_path / "g.toy")
    assert info.exit_code == 0, info.stderr
    listed = json.loads(info.stdout)
    assert listed["format"] == "toy"
    assert [(t["name"], t["shape"], t["dtype"]) for t in listed["tensors"]] == [
        ("w", [30, 20], "float32"), ("b", [20], "float32"), ("steps", [4], "int8")]

    report = run("report", "--json", tmp_path / "g.toy")
    assert report.exit_code == 0, report.stderr
    norms = {t["name"]: t["norm"] for t in json.loads(report.stdout)["tensors"]}
    assert norms["w"] == pytest.approx(float(np.linalg.norm(w.astype(np.float64))), rel=1e-12)
    assert norms["steps"] is None

    clipped = run("norm", "--clip", "1", "--axes", "1", tmp_path / "g.toy")
    assert clipped.exit_code == 0, clipped.stderr
    got = toy.read(tmp_path / "g.clipped.toy")
    np.testing.assert_array_equal(got["b"], b)  # rank 1 cannot take axis 1: left unchanged
    np.testing.assert_array_equal(got["w"], tclip.clip_by_norm(w, 1.0, axes=1))
    np.testing.assert_array_equal(got["steps"], steps)


def test_a_toy_file_converts_to_and_from_another_format(tmp_path, toy):
    w = RNG.standard_normal((8, 8)).astype(np.float32)
    np.save(tmp_path / "w.npy", w)
    result = run("global", "--clip", "2", "-o", tmp_path / "w.toy", tmp_path / "w.npy")
    assert result.exit_code == 0, result.stderr
    want, _ = tclip.clip_by_global_norm([w], 2.0)
    np.testing.assert_array_equal(toy.read(tmp_path / "w.toy")["w"], want[0])
    back = run("norm", "--clip", "100", "-o", tmp_path / "back.npy", tmp_path / "w.toy")
    assert back.exit_code == 0, back.stderr
    np.testing.assert_array_equal(np.load(tmp_path / "back.npy"), want[0])


def test_a_logical_tensor_is_measured_through_its_encoding(tmp_path, toy):
    """The seam for quantized weights: pass 1 reads the values an encoding gives, not the stored codes."""
    codes = RNG.integers(-100, 100, (40, 70)).astype(np.int8)
    toy.write(tmp_path / "q.toy", {"x.codes": codes, "x.scale": np.array([0.25], np.float32),
                                   "y": np.ones(3, np.float32)})
    report = run("report", "--json", "--axes", "1", tmp_path / "q.toy")
    assert report.exit_code == 0, report.stderr
    tensors = {t["name"]: t for t in json.loads(report.stdout)["tensors"]}
    assert set(tensors) == {"x", "y"}
    values = codes.astype(np.float64) * 0.25
    assert tensors["x"]["norm"] == pytest.approx(float(np.linalg.norm(values)), rel=1e-12)
    assert tensors["x"]["max"] == pytest.approx(float(values.max()))
    assert tensors["x"]["slices"] == 40


def test_a_run_that_meets_no_hdf5_file_never_imports_h5py(tmp_path):
    np.save(tmp_path / "g.npy", np.ones((4, 4), np.float32))
    code = ("import sys\n"
            "from click.testing import CliRunner\n"
            "from tclip.cli import cli\n"
            f"for args in (['report', {str(tmp_path / 'g.npy')!r}], ['norm', '--clip', '1', {str(tmp_path / 'g.npy')!r}],"
            f" ['info', {str(tmp_path / 'g.npy')!r}]):\n"
            "    assert CliRunner().invoke(cli, args).exit_code == 0\n"
            "print('h5py' in sys.modules, 'tclip.formats.hdf5' in sys.modules)\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.split() == ["False", "True"]  # the format module is there, its library is not


def test_a_run_that_meets_no_pytorch_or_gguf_file_never_imports_their_parsers(tmp_path):
    """Start-up pays for what the files at hand need: the pickle machine, zipfile, the GGUF
    header parser and block arithmetic, secrets and socket cost some 30 ms together."""
    np.save(tmp_path / "g.npy", np.ones((4, 4), np.float32))
    (tmp_path / "p.pt").write_bytes(b"\x80\x02not a pickle at all")  # sniffed, so the parser is loaded
    heavy = ["tclip.formats.torch.unpickler", "tclip.formats.torch.archive", "zipfile", "tclip.formats.gguf.header",
             "tclip.quant.ggml.blocks", "secrets", "socket"]
    code = ("import sys\n"
            "from click.testing import CliRunner\n"
            "from tclip.cli import cli\n"
            f"for args in (['report', {str(tmp_path / 'g.npy')!r}], ['norm', '--clip', '1', {str(tmp_path / 'g.npy')!r}]):\n"
            "    assert CliRunner().invoke(cli, args).exit_code == 0\n"
            f"print(*[m in sys.modules for m in {heavy!r}])\n"
            f"CliRunner().invoke(cli, ['report', {str(tmp_path / 'p.pt')!r}])\n"
            "print('tclip.formats.torch.unpickler' in sys.modules)\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    first, second = result.stdout.splitlines()
    assert first.split() == ["False"] * len(heavy)
    assert second == "True"


def test_a_malformed_toy_file_is_one_clean_error(tmp_path, toy):
    (tmp_path / "bad.toy").write_bytes(toy.MAGIC + b"\xff\xff\xff\x7f")  # a count of tensors that is not there
    result = run("report", tmp_path / "bad.toy")
    assert result.exit_code == 1
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"Error: {tmp_path / 'bad.toy'}: malformed toy file (")


def q8_0_blocks(values: np.ndarray) -> bytes:
    """ggml Q8_0 blocks of ``values`` (rows of whole blocks of 32): a float16 scale ``amax / 127``
    and 32 int8 codes each, as ggml's quantize_row_q8_0 writes them."""
    blocks = values.reshape(-1, 32).astype(np.float64)
    scales = (np.abs(blocks).max(axis=1) / 127).astype(np.float16)
    safe = np.where(scales == 0, 1, scales.astype(np.float64))
    codes = np.clip(np.rint(blocks / safe[:, None]), -127, 127).astype(np.int8)
    out = np.empty((blocks.shape[0], 34), np.uint8)
    out[:, :2] = scales.astype("<f2").view(np.uint8).reshape(-1, 2)
    out[:, 2:] = codes.view(np.uint8)
    return out.tobytes()


def q8_0_values(raw: bytes) -> np.ndarray:
    blocks = np.frombuffer(raw, np.uint8).reshape(-1, 34)
    scales = blocks[:, :2].copy().view("<f2").astype(np.float64)
    return (blocks[:, 2:].view(np.int8).astype(np.float64) * scales).reshape(-1)


def test_one_stored_tensor_of_quantized_blocks_is_measured_gated_and_clipped(tmp_path, toy):
    """The seam's second kind: an encoding over one stored tensor of blocks (ggml Q8_0 here, as GGUF
    stores weights) gives closed-form norms, finds NaN scales, and is rescaled by its block scales."""
    weight = "model.layers.3.mlp.down_proj.weight"
    raw = q8_0_blocks(RNG.standard_normal((24, 96)).astype(np.float32))
    toy.write(tmp_path / "q.toy", {"model.norm.weight": np.ones(8, np.float32)}, q8={weight: ((24, 96), raw)})
    report = run("report", "--json", tmp_path / "q.toy")
    assert report.exit_code == 0, report.stderr
    tensors = {t["name"]: t for t in json.loads(report.stdout)["tensors"]}
    values = q8_0_values(raw)
    assert tensors[weight]["norm"] == pytest.approx(float(np.linalg.norm(values)), rel=1e-15)
    assert tensors[weight]["dtype"] == "Q8_0" and tensors[weight]["nbytes"] == len(raw)
    assert tensors[weight]["max"] == values.max() and tensors[weight]["quantization"]["parts"][0]["role"] == "blocks"

    result = run("global", "--clip", "2", "--json", tmp_path / "q.toy")
    assert result.exit_code == 0, result.stderr
    with toy.ToyReader(tmp_path / "q.clipped.toy") as reader:
        new = bytes(reader.read_part(weight, 0, len(raw)))
    old_blocks, new_blocks = np.frombuffer(raw, np.uint8).reshape(-1, 34), np.frombuffer(new, np.uint8).reshape(-1, 34)
    assert np.array_equal(old_blocks[:, 2:], new_blocks[:, 2:])  # codes byte for byte, only scales rewritten
    factor = 2 / math.hypot(float(np.linalg.norm(values)), float(np.sqrt(8)))
    assert float(np.linalg.norm(q8_0_values(new))) == pytest.approx(float(np.linalg.norm(values)) * factor,
                                                                    rel=2 ** -10)
    clipped = {t["name"]: t for t in json.loads(result.stdout)["tensors"]}
    assert clipped[weight]["norm_after"] == pytest.approx(float(np.linalg.norm(q8_0_values(new))), rel=1e-15)

    broken = bytearray(raw)
    broken[34 * 5:34 * 5 + 2] = np.array([np.nan], "<f2").tobytes()  # the sixth block's scale
    toy.write(tmp_path / "nan.toy", {}, q8={weight: ((24, 96), bytes(broken))})
    gate = run("report", "--max-norm", "1e9", "-q", tmp_path / "nan.toy")
    assert gate.exit_code == 3, gate.output
    assert f"NaN scale in {weight} block 5" in gate.stderr, gate.stderr
