"""The sum of exp_avg_sq that --of grads starts from is exact until rounded once to float64
(tclip.work.adam.exact_sum), for every float dtype, subnormals, signs and huge ranges."""

from __future__ import annotations

import math

import ml_dtypes
import numpy as np
import pytest
from safetensors.numpy import save_file

from tclip.formats.registry import open_reader
from tclip.work import adam


def summed(tmp_path, values: np.ndarray) -> float:
    save_file({"t": values}, str(tmp_path / "t.safetensors"))
    with open_reader(tmp_path / "t.safetensors") as reader:
        return adam.exact_sum(reader, "t")


@pytest.mark.parametrize("dtype", [np.float32, np.float16, ml_dtypes.bfloat16, np.float64])
def test_exact_for_any_values(tmp_path, dtype):
    rng = np.random.default_rng(7)
    for case in range(40):
        low, high = (-7, 3) if dtype is np.float16 else (-40, 30)  # within the dtype's range
        values = rng.standard_normal(int(rng.integers(1, 2000))) * 10.0 ** float(rng.integers(low, high))
        values[rng.random(values.size) < 0.1] = 1e-45 * float(rng.integers(1, 50))  # float32 subnormals
        values = values.astype(dtype)
        expected = math.fsum(values.astype(np.float64).tolist())
        assert summed(tmp_path, values) == expected, (dtype, case)


def test_exact_where_float64_summation_is_not(tmp_path):
    values = np.array([2.0 ** 30, 1.0, -(2.0 ** 30)] + [2.0 ** -24] * 3, dtype=np.float32)
    assert summed(tmp_path, values) == 1.0 + 3 * 2.0 ** -24
    big = np.array([3e38, 3e38, -3e38], dtype=np.float32)  # an intermediate past float32's range
    assert summed(tmp_path, big) == float(np.float32(3e38))


def test_chunks_are_exact_too(tmp_path, monkeypatch):
    monkeypatch.setattr(adam, "_CHUNK", 7)
    values = (np.arange(1, 100, dtype=np.float32) * np.float32(0.1)) ** 3
    assert summed(tmp_path, values) == math.fsum(values.astype(np.float64).tolist())


def test_nan_and_inf_propagate(tmp_path):
    assert math.isnan(summed(tmp_path, np.array([1.0, np.nan], dtype=np.float32)))
    assert summed(tmp_path, np.array([1.0, np.inf], dtype=np.float32)) == math.inf
