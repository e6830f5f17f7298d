"""Regenerate tf_reference.npz: random cases run through TensorFlow itself.

The test suite must not need TensorFlow (a 600 MB install), so this script is
run by hand in an environment that has it, and its output is committed:

    python -m venv tf-env && tf-env/bin/pip install tensorflow-cpu==2.21.0
    tf-env/bin/python tests/reference/make_tf_reference.py

Each case stores its inputs and TensorFlow's outputs as arrays named
``{case}/in{j}`` and ``{case}/out{j}``, and its function and parameters as JSON
in ``{case}/params`` (a 0-d unicode array: no pickle is needed to read it).
"""

from __future__ import annotations

import json
import pathlib

import numpy as np
import tensorflow as tf

HERE = pathlib.Path(__file__).parent
RNG = np.random.default_rng(20261122)
CASES_PER_FUNCTION = 120


def random_tensor(dtype: str, min_rank: int = 0) -> np.ndarray:
    rank = int(RNG.integers(min_rank, 5))
    shape = tuple(int(n) for n in RNG.integers(1, 6, size=rank))
    scale = 10.0 ** RNG.uniform(-3, 3)
    return (RNG.standard_normal(shape) * scale).astype(dtype)


def random_clip_norm(t: np.ndarray) -> float:
    # Around the tensor's own norm, so roughly half of the cases clip.
    reference = float(np.linalg.norm(t.astype(np.float64))) or 1.0
    return float(reference * 10.0 ** RNG.uniform(-1.5, 1.0))


def random_axes(rank: int) -> object:
    kind = RNG.integers(0, 4)
    if kind == 0 or rank == 0:
        return None
    if kind == 1:
        return int(RNG.integers(-rank, rank))
    count = int(RNG.integers(1, rank + 1))
    axes = RNG.choice(rank, size=count, replace=False)
    return [int(a) - (rank if RNG.random() < 0.3 else 0) for a in axes]


def main() -> None:
    arrays: dict[str, np.ndarray] = {}
    case = 0

    def store(function: str, params: dict, inputs: list, outputs: list) -> None:
        nonlocal case
        key = f"c{case:04d}"
        arrays[f"{key}/params"] = np.array(json.dumps({"function": function, **params}))
        for j, x in enumerate(inputs):
            arrays[f"{key}/in{j}"] = np.asarray(x)
        for j, y in enumerate(outputs):
            arrays[f"{key}/out{j}"] = np.asarray(y)
        case += 1

    for dtype in ("float32", "float64"):
        for _ in range(CASES_PER_FUNCTION):
            t = random_tensor(dtype)
            lo, hi = sorted(RNG.standard_normal(2) * np.abs(t).max(initial=1.0))
            out = tf.clip_by_value(t, float(lo), float(hi)).numpy()
            store("clip_by_value", {"min": float(lo), "max": float(hi)}, [t], [out])

            t = random_tensor(dtype)
            c, axes = random_clip_norm(t), random_axes(t.ndim)
            out = tf.clip_by_norm(t, c, axes=axes).numpy()
            store("clip_by_norm", {"clip_norm": c, "axes": axes}, [t], [out])

            if dtype == "float32":  # TensorFlow's clip_by_average_norm takes float32 only
                t = random_tensor(dtype)
                c = random_clip_norm(t) / t.size
                out = tf.compat.v1.clip_by_average_norm(t, c).numpy()
                store("clip_by_average_norm", {"clip_norm": c}, [t], [out])

            tensors = [random_tensor(dtype) for _ in range(int(RNG.integers(1, 5)))]
            g = tf.linalg.global_norm(tensors).numpy()
            store("global_norm", {}, tensors, [g])

            tensors = [random_tensor(dtype) for _ in range(int(RNG.integers(1, 5)))]
            c = random_clip_norm(np.concatenate([x.ravel() for x in tensors]))
            use_norm = None
            if RNG.random() < 0.3:
                use_norm = float(10.0 ** RNG.uniform(-2, 3))
            clipped, g = tf.clip_by_global_norm(
                tensors, c, use_norm=None if use_norm is None else tf.constant(use_norm, dtype)
            )
            store("clip_by_global_norm", {"clip_norm": c, "use_norm": use_norm}, tensors,
                  [x.numpy() for x in clipped] + [g.numpy()])

            if RNG.random() < 0.5:
                t = random_tensor(dtype, min_rank=1)
                ord_ = [1, 2, np.inf, "euclidean", 1.5, 3.0, 0.5][int(RNG.integers(0, 7))]
                axis = None if RNG.random() < 0.4 else int(RNG.integers(-t.ndim, t.ndim))
            else:
                t = random_tensor(dtype, min_rank=2)
                ord_ = ["fro", "euclidean", 1, 2, np.inf][int(RNG.integers(0, 5))]
                first, second = RNG.choice(t.ndim, size=2, replace=False)
                axis = [int(first), int(second) - (t.ndim if RNG.random() < 0.3 else 0)]
            keepdims = bool(RNG.random() < 0.3)
            out = tf.norm(t, ord=ord_, axis=tuple(axis) if isinstance(axis, list) else axis,
                          keepdims=keepdims).numpy()
            store("norm", {"ord": "inf" if ord_ == np.inf else ord_, "axis": axis, "keepdims": keepdims},
                  [t], [out])

    np.savez_compressed(HERE / "tf_reference.npz", **arrays)
    print(f"{case} cases written to {HERE / 'tf_reference.npz'}")


if __name__ == "__main__":
    main()
