"""Agreement with TensorFlow 2.21 on 1,320 random cases (see reference/make_tf_reference.py)."""

from __future__ import annotations

import json

import numpy as np
import pytest

import support
import tclip

REFERENCE = support.TESTS / "reference" / "tf_reference.npz"


def load_cases() -> list[tuple[str, dict, list[np.ndarray], list[np.ndarray]]]:
    cases = []
    with np.load(REFERENCE, allow_pickle=False) as data:
        keys = sorted({k.split("/")[0] for k in data.files})
        for key in keys:
            params = json.loads(str(data[f"{key}/params"]))
            inputs = [data[f"{key}/in{j}"] for j in range(32) if f"{key}/in{j}" in data.files]
            outputs = [data[f"{key}/out{j}"] for j in range(32) if f"{key}/out{j}" in data.files]
            cases.append((key, params, inputs, outputs))
    return cases


CASES = load_cases()


def assert_close_to_tf(ours: np.ndarray, theirs: np.ndarray, dtype: np.dtype) -> None:
    ours, theirs = np.asarray(ours), np.asarray(theirs)
    assert ours.shape == theirs.shape
    # TensorFlow rounds in the input dtype at every step; we round once from float64.
    rtol = 1e-5 if np.dtype(dtype) == np.float32 else 1e-12
    atol = rtol * float(np.max(np.abs(theirs), initial=0.0))
    np.testing.assert_allclose(ours, theirs, rtol=rtol, atol=atol)


def run_case(params: dict, inputs: list[np.ndarray]) -> list:
    function = params["function"]
    if function == "clip_by_value":
        return [tclip.clip_by_value(inputs[0], params["min"], params["max"])]
    if function == "clip_by_norm":
        return [tclip.clip_by_norm(inputs[0], params["clip_norm"], axes=params["axes"])]
    if function == "clip_by_average_norm":
        return [tclip.clip_by_average_norm(inputs[0], params["clip_norm"])]
    if function == "global_norm":
        return [tclip.global_norm(inputs)]
    if function == "clip_by_global_norm":
        clipped, g = tclip.clip_by_global_norm(inputs, params["clip_norm"], use_norm=params["use_norm"])
        return [*clipped, g]
    assert function == "norm"
    ord_ = np.inf if params["ord"] == "inf" else params["ord"]
    axis = tuple(params["axis"]) if isinstance(params["axis"], list) else params["axis"]
    return [tclip.norm(inputs[0], ord=ord_, axis=axis, keepdims=params["keepdims"])]


def test_reference_covers_every_function():
    functions = {params["function"] for _, params, _, _ in CASES}
    assert functions == {"clip_by_value", "clip_by_norm", "clip_by_average_norm",
                         "global_norm", "clip_by_global_norm", "norm"}
    assert len(CASES) > 1000


@pytest.mark.parametrize("key,params,inputs,outputs", CASES, ids=[c[0] for c in CASES])
def test_agrees_with_tensorflow(key, params, inputs, outputs):
    ours = run_case(params, inputs)
    assert len(ours) == len(outputs)
    for mine, theirs in zip(ours, outputs):
        if isinstance(mine, np.ndarray) and theirs.ndim:
            assert mine.dtype == theirs.dtype
        assert_close_to_tf(mine, theirs, inputs[0].dtype)
