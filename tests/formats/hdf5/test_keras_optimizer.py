"""Issue 20.5: a Keras file's optimizer state (Adam moments, iteration count, learning rate) is
never scaled with the weights unless an include pattern names it, and the output says so.

The fixtures are written by real Keras (``tests/fixtures/make_keras_fixtures.py``)."""

from __future__ import annotations

import json
from pathlib import Path

import h5py
import numpy as np
import pytest

import support
from support.cli import run80 as run


KERAS = support.FIXTURES / "keras"
LAYOUTS = {
    "adam.weights.h5": ("layers/", "optimizer/"),  # Keras 3: model.save_weights
    "adam_legacy.h5": ("model_weights/", "optimizer_weights/"),  # model.save("….h5")
}


def datasets(path: Path) -> dict[str, np.ndarray]:
    out = {}
    with h5py.File(path, "r") as f:
        f.visititems(lambda name, obj: out.__setitem__(name, obj[()]) if isinstance(obj, h5py.Dataset) else None)
    return out


@pytest.mark.parametrize("fixture", sorted(LAYOUTS))
def test_global_clip_leaves_the_optimizer_state_alone(tmp_path, fixture):
    weights, optimizer = LAYOUTS[fixture]
    source = KERAS / fixture
    before = datasets(source)
    state = [n for n in before if n.startswith(optimizer)]
    assert len(state) == 10  # iterations, learning rate, two moments of four weights
    out = tmp_path / fixture
    result = run("global", "--clip", "1", "--json", "-o", out, source)
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    after = datasets(out)
    for name in state:
        assert after[name].tobytes() == before[name].tobytes(), name
    model = [n for n in before if n.startswith(weights)]
    norm = np.sqrt(sum(np.sum(before[n].astype(np.float64) ** 2) for n in model))
    assert norm > 1 and data["global_norm"] == pytest.approx(norm, rel=1e-12)
    assert np.sqrt(sum(np.sum(after[n].astype(np.float64) ** 2) for n in model)) == pytest.approx(1.0, rel=1e-6)
    skipped = {t["name"]: t["skipped"] for t in data["tensors"] if t["skipped"]}
    assert set(skipped) == set(state)
    assert all(reason.startswith("optimizer state") for reason in skipped.values())
    warning = [w for w in data["warnings"] if "optimizer variables" in w]
    assert len(warning) == 1 and warning[0].startswith("10 optimizer variables (a training optimizer's moments, "
                                                       "step counts, learning rate) left unchanged: ")
    assert warning[0].endswith("and 7 more; name them with --include to work on them too")


def test_an_include_pattern_selects_the_optimizer_state(tmp_path):
    source = KERAS / "adam.weights.h5"
    before = datasets(source)
    out = tmp_path / "all.weights.h5"
    result = run("global", "--clip", "1", "-q", "--include", "layers/*", "--include", "optimizer/*", "-o", out, source)
    assert result.exit_code == 0, result.output
    after = datasets(out)
    floating = [n for n in before if before[n].dtype.kind == "f"]
    total = np.sqrt(sum(np.sum(after[n].astype(np.float64) ** 2) for n in floating))
    assert total == pytest.approx(1.0, rel=1e-6)  # the moments and the learning rate were scaled too
    assert after["optimizer/vars/0"] == before["optimizer/vars/0"]  # the iteration count is an integer


def test_the_report_shows_the_state_but_keeps_it_out_of_the_global_norm():
    source = KERAS / "adam.weights.h5"
    before = datasets(source)
    result = run("report", "--json", source)
    assert result.exit_code == 0
    data = json.loads(result.stdout)
    tensors = {t["name"]: t for t in data["tensors"]}
    moment = before["optimizer/vars/2"].astype(np.float64)
    assert tensors["optimizer/vars/2"]["norm"] == pytest.approx(np.linalg.norm(moment), rel=1e-12)
    model = [n for n in before if n.startswith("layers/")]
    assert data["global_norm"] == pytest.approx(
        np.sqrt(sum(np.sum(before[n].astype(np.float64) ** 2) for n in model)), rel=1e-12)
    assert any("left out of the global norm" in w for w in data["warnings"])


def test_a_plain_hdf5_file_with_an_optimizer_group_is_not_keras(tmp_path):
    path = tmp_path / "grads.h5"
    with h5py.File(path, "w") as f:
        f.create_dataset("optimizer/vars/0", data=np.full(4, 3.0, np.float32))
        f.create_dataset("encoder/w", data=np.full(4, 4.0, np.float32))
    data = json.loads(run("global", "--clip", "1", "--json", "--dry-run", path).stdout)
    assert all(t["skipped"] is None for t in data["tensors"]) and data["global_norm"] == 10.0
