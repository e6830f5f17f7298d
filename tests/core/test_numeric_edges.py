"""Numbers at the edges of their types: ``--clip inf`` leaves every tensor bit-identical even when
its norm overflows, huge complex values leak no NumPy warning, and a PyTorch tensor of a dtype
tclip cannot read (complex32) is carried byte for byte while the rest are clipped."""

from __future__ import annotations

import warnings

import numpy as np
import pytest

from support.cli import run



HUGE = {"model.layers.0.mlp.down_proj.weight": np.array([[3e200, 1.0], [1.0, 2.0]]),
        "model.layers.0.mlp.down_proj.bias": np.array([3e200, 1.0]),
        "model.norm.weight": np.array([0.5, -0.25], np.float32)}


@pytest.mark.parametrize("command", [["global", "--clip", "inf"], ["norm", "--clip", "inf"],
                                     ["norm", "--clip", "inf", "--axes", "1"],
                                     ["global", "--clip", "inf", "--nonfinite", "propagate"]],
                         ids=["global", "norm", "norm-axes", "global-propagate"])
def test_clip_inf_leaves_tensors_whose_norm_overflows_bit_identical(tmp_path, command):
    source = tmp_path / "grads.npz"
    np.savez(source, **HUGE)
    result = run(*command, "-o", tmp_path / "out.npz", source)
    assert result.exit_code == 0, result.output
    with np.load(tmp_path / "out.npz") as out:
        for name, array in HUGE.items():
            assert out[name].dtype == array.dtype and out[name].tobytes() == array.tobytes(), name


def test_clip_inf_keeps_a_single_npy_byte_for_byte(tmp_path):
    source = tmp_path / "big.npy"
    np.save(source, np.array([3e200, 1.0]))
    result = run("global", "--clip", "inf", "-o", tmp_path / "out.npy", source)
    assert result.exit_code == 0, result.output
    assert (tmp_path / "out.npy").read_bytes() == source.read_bytes()


COMPLEX = np.array([[1e200 + 1e200j, 1.0 + 0j], [2.0 - 1j, 0.5j]], np.complex128)


@pytest.mark.parametrize("command", [["report"], ["report", "--json"], ["report", "--axes", "1"],
                                     ["norm", "--clip", "1"], ["global", "--clip", "1"],
                                     ["norm", "--clip", "1", "--axes", "1"], ["info"]])
def test_huge_complex_values_leak_no_numpy_warning(tmp_path, command):
    source = tmp_path / "spectrum.npz"
    np.savez(source, **{"encoder.fft.weight": COMPLEX, "encoder.proj.weight": np.ones((2, 2), np.float32)})
    with warnings.catch_warnings():
        warnings.simplefilter("default")  # printed as the command line prints them, not raised
        result = run(*command, "--force", "-o", tmp_path / "out.npz", source) if command[0] != "report" \
            and command[0] != "info" else run(*command, source)
    assert result.exit_code == 0, result.output
    assert "encountered" not in result.stderr and "Warning: " not in result.stderr, result.stderr


def test_complex_norm_rows_are_right(tmp_path):
    source = tmp_path / "spectrum.npy"
    np.save(source, np.array([[3.0 + 4.0j, 0.0], [1e-3j, 0.0]], np.complex128))
    result = run("report", "--json", "--axes", "1", source)
    assert result.exit_code == 0, result.output
    assert '"norm": 5.0' in result.stdout or '"max_slice_norm": 5.0' in result.stdout, result.stdout


def _chalf_file(path):
    torch = pytest.importorskip("torch")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch: "ComplexHalf support is experimental"
        generator = torch.Generator().manual_seed(15)
        rotary = torch.randn(6, dtype=torch.chalf, generator=generator)
        weight = torch.randn(4, 4, generator=generator) * 3
        torch.save({"model.layers.0.mlp.up_proj.weight": weight, "model.rotary_emb.freqs": rotary}, path)
    return weight.numpy(), rotary.view(torch.int32).numpy().tobytes()


def test_a_complex32_tensor_is_carried_and_the_rest_clipped(tmp_path):
    source = tmp_path / "model.pt"
    weight, rotary_bytes = _chalf_file(source)
    report = run("report", "--json", source)
    assert report.exit_code == 0, report.output
    assert "complex32" in report.stdout
    result = run("norm", "--clip", "1", source)
    assert result.exit_code == 0, result.output
    skipped = [line for line in result.stdout.splitlines() if line.startswith("skipped")]
    assert skipped == ["skipped (torch.complex32 (not supported) is not numeric): model.rotary_emb.freqs"], \
        result.stdout
    assert run("report", "--max-norm", "100", source).exit_code != 0  # never measured: no check passes over it
    torch = pytest.importorskip("torch")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = torch.load(tmp_path / "model.clipped.pt", weights_only=True)
        assert out["model.rotary_emb.freqs"].dtype == torch.chalf
        assert out["model.rotary_emb.freqs"].view(torch.int32).numpy().tobytes() == rotary_bytes
        clipped = out["model.layers.0.mlp.up_proj.weight"].numpy()
    np.testing.assert_allclose(clipped, weight / np.linalg.norm(weight.astype(np.float64)), rtol=1e-6)


NEAR_MAX = {"model.embed_tokens.weight": np.array([[1.5e308, 1.5e308], [-1.7e308, 1e-300]]),
            "model.layers.0.mlp.up_proj.weight": np.full((4, 2), 1e154)}


@pytest.mark.parametrize("command", [["report", "--json", "--axes", "1"], ["report", "--stats"],
                                     ["report", "--ord", "1"], ["report", "--ord", "1", "--axes", "1"]],
                         ids=["moments", "stats", "l1", "l1-rows"])
def test_float64_sums_past_the_largest_float_leak_no_numpy_warning(tmp_path, command):
    # The sum of the values (for the mean), of their magnitudes (L1) or of per-row sums of
    # squares passes float64's largest: the result is inf, said once by tclip, never by NumPy.
    source = tmp_path / "embeddings.npz"
    np.savez(source, **NEAR_MAX)
    with warnings.catch_warnings():
        warnings.simplefilter("default")
        result = run(*command, source)
    assert result.exit_code == 0, result.output
    assert "encountered" not in result.stderr and "Warning: " not in result.stderr, result.stderr


def test_the_api_keeps_tensors_for_an_infinite_limit_and_an_overflowing_norm():
    import tclip

    tensors = [np.array([3e200, 1.0]), np.array([0.5], np.float32)]
    clipped, g = tclip.clip_by_global_norm(tensors, float("inf"))
    assert g == float("inf")
    assert [c.tobytes() for c in clipped] == [t.tobytes() for t in tensors]
    nan_clipped, nan_g = tclip.clip_by_global_norm([np.array([np.nan, 1.0])], float("inf"))
    assert np.isnan(nan_g) and np.isnan(nan_clipped[0]).all()  # a NaN norm still poisons, as in TensorFlow
