"""`tclip diff`: two checkpoints compared tensor by tensor, in any formats (issue 9)."""

from __future__ import annotations

import json
import math

import h5py
import ml_dtypes
import numpy as np
import pytest

from support.cli import run
from support.formats_helpers import safetensors_bytes
from support.helpers import PickleTrap
from tclip.core.units import UNIT_ELEMENTS
from tclip.work.diff import diff_files
from tclip.work.mapping import parse_mapping

RNG = np.random.default_rng(21)
TENSORS = {
    "model.layers.0.w": (RNG.standard_normal((40, 30)) * 3).astype(np.float32),
    "model.layers.1.w": (RNG.standard_normal((30, 20)) * 0.5).astype(np.float32),
    "model.norm.b": RNG.standard_normal(20).astype(np.float64),
    "step": np.array([7], np.int64),  # (the safetensors library writes a 0-d tensor as shape [1])
}


def st(path, tensors):
    path.write_bytes(safetensors_bytes(tensors))
    return path


def by_name(report):
    return {t.name: t for t in report.tensors}


def test_identical_files_in_two_formats_are_the_same(tmp_path):
    a = st(tmp_path / "a.safetensors", TENSORS)
    b = tmp_path / "b.npz"
    np.savez(b, **TENSORS)
    result = run("diff", a, b)
    assert result.exit_code == 0, result.output
    assert "same: 4 compared, 0 differ" in result.stdout
    report = diff_files(a, b)
    assert not report.differs and report.global_diff_norm == 0
    assert all(t.cosine == 1.0 and t.outside == 0 for t in report.tensors)


def test_clipped_file_against_its_input(tmp_path):
    a = st(tmp_path / "g.safetensors", TENSORS)
    assert run("norm", "--clip", "20", "-q", a).exit_code == 0
    b = tmp_path / "g.clipped.safetensors"
    result = run("diff", "--json", a, b)
    assert result.exit_code == 3
    data = json.loads(result.stdout)
    from tclip.formats import open_reader

    with open_reader(b) as reader:
        after = {n: reader.read(n) for n in reader.tensors}
    differing = {t["name"] for t in data["tensors"] if t["differs"]}
    clipped = {n for n in TENSORS if np.linalg.norm(TENSORS[n].astype(np.float64)) > 20}
    assert differing == clipped and clipped
    for t in data["tensors"]:
        a_values, b_values = TENSORS[t["name"]].astype(np.float64), after[t["name"]].astype(np.float64)
        assert t["diff_norm"] == pytest.approx(np.linalg.norm(a_values - b_values), rel=1e-12, abs=0)
        assert t["max_abs_diff"] == pytest.approx(np.max(np.abs(a_values - b_values)), rel=1e-12)
        assert t["outside"] == int(np.count_nonzero(a_values != b_values))
        norm_a = np.linalg.norm(a_values)
        assert t["relative"] == pytest.approx(np.linalg.norm(a_values - b_values) / norm_a if norm_a else 0)
        cosine = np.dot(a_values.ravel(), b_values.ravel()) / (norm_a * np.linalg.norm(b_values))
        assert t["cosine"] == pytest.approx(cosine, rel=1e-12)
    every = math.sqrt(sum(np.sum((TENSORS[n].astype(np.float64) - after[n]) ** 2) for n in TENSORS))
    assert data["global_diff_norm"] == pytest.approx(every, rel=1e-12)
    assert data["same"] is False and data["tensors_differing"] == len(clipped)


def test_hdf5_against_safetensors_and_fortran_npy(tmp_path):
    a = tmp_path / "a.h5"
    with h5py.File(a, "w") as f:
        for name, array in TENSORS.items():
            f.create_dataset(name.replace(".", "/"), data=array, chunks=array.shape or None)
    b = st(tmp_path / "b.safetensors", {k.replace(".", "/"): v for k, v in TENSORS.items()})
    assert not diff_files(a, b).differs
    f = tmp_path / "f.npy"
    np.save(f, np.asfortranarray(TENSORS["model.layers.0.w"]))
    c = st(tmp_path / "f.safetensors", {"f": TENSORS["model.layers.0.w"]})
    assert not diff_files(f, c).differs
    np.save(f, np.asfortranarray(TENSORS["model.layers.0.w"] * 2))
    assert by_name(diff_files(f, c))["f"].outside == np.count_nonzero(TENSORS["model.layers.0.w"])


def test_map_renames_missing_extra_and_shapes(tmp_path):
    a = st(tmp_path / "a.safetensors", {"module.w": np.ones(3, np.float32), "module.v": np.ones((2, 2), np.float32),
                                        "module.only_a": np.ones(1, np.float32)})
    b = st(tmp_path / "b.safetensors", {"w": np.ones(3, np.float32), "v": np.ones((4,), np.float32),
                                        "only_b": np.ones(1, np.float32)})
    report = diff_files(a, b, mapping=parse_mapping(["module.*=*"]))
    statuses = {t.name: t.status for t in report.tensors}
    assert statuses == {"module.w": "compared", "module.v": "shape differs", "module.only_a": "only in A",
                        "only_b": "only in B"}
    assert report.differs
    result = run("diff", "--map", "module.*=*", a, b)
    assert result.exit_code == 3
    assert "only in A: module.only_a" in result.stdout and "only in B: only_b" in result.stdout
    assert "shape differs: module.v (2×2 vs 4)" in result.stdout
    assert run("diff", "--map", "nonsense", a, b).exit_code == 2


def test_dtypes_compared_as_values_and_tolerances(tmp_path):
    x = RNG.standard_normal(1000).astype(np.float32)
    a = st(tmp_path / "a.safetensors", {"x": x})
    same_values = st(tmp_path / "b.safetensors", {"x": x.astype(np.float64)})
    report = diff_files(a, same_values)
    assert not report.differs and "dtypes differ" in report.tensors[0].note
    rounded = st(tmp_path / "c.safetensors", {"x": x.astype(ml_dtypes.bfloat16)})
    exact = diff_files(a, rounded).tensors[0]
    y = x.astype(ml_dtypes.bfloat16).astype(np.float64)
    assert exact.outside == int(np.count_nonzero(x.astype(np.float64) != y))
    loose = diff_files(a, rounded, rtol=2 ** -8).tensors[0]
    assert loose.outside == int(np.count_nonzero(~np.isclose(x.astype(np.float64), y, rtol=2 ** -8, atol=0)))
    assert loose.outside == 0
    assert run("diff", "--rtol", "0.004", a, rounded).exit_code == 0
    ints = st(tmp_path / "i.safetensors", {"x": np.array([2 ** 62, 1], np.int64)})
    ints_off = st(tmp_path / "j.safetensors", {"x": np.array([2 ** 62 + 1, 1], np.int64)})
    assert diff_files(ints, ints_off).tensors[0].outside == 1  # exactly, not in float64


def test_nan_equals_nan_and_infinities(tmp_path):
    a = st(tmp_path / "a.safetensors", {"t": np.array([np.nan, np.inf, 1.0, -np.inf, 2.0], np.float32)})
    b = st(tmp_path / "b.safetensors", {"t": np.array([np.nan, np.inf, 1.0, -np.inf, 2.0], np.float32)})
    assert not diff_files(a, b).differs
    c = st(tmp_path / "c.safetensors", {"t": np.array([1.0, -np.inf, 1.0, -np.inf, np.nan], np.float32)})
    entry = diff_files(a, c).tensors[0]
    assert entry.nonfinite_mismatch == 3 and entry.differs
    assert entry.diff_norm == 0.0  # over the positions where both are finite


def test_many_tensors_larger_than_the_memory_budget(tmp_path):
    tensors = {f"t{i}": RNG.standard_normal(UNIT_ELEMENTS + i).astype(np.float32) for i in range(20)}
    a = st(tmp_path / "a.safetensors", tensors)
    changed = dict(tensors)
    changed["t7"] = changed["t7"].copy()
    changed["t7"][5] += 1
    b = st(tmp_path / "b.safetensors", changed)
    reports = [diff_files(a, b, memory=16 << 20, threads=t, block_bytes=bb) for t, bb in ((1, 1), (3, None), (2, 7))]
    first = reports[0].to_json()
    for other in reports[1:]:
        data = other.to_json()
        data["elapsed_s"] = first["elapsed_s"]
        assert data == first
    assert [t.name for t in reports[0].tensors if t.differs] == ["t7"]
    assert by_name(reports[0])["t7"].max_abs_diff == pytest.approx(1.0, rel=1e-6)


def test_unreadable_file_is_exit_1(tmp_path):
    a = st(tmp_path / "a.safetensors", TENSORS)
    (tmp_path / "bad.safetensors").write_bytes(b"\x01\x02")
    result = run("diff", a, tmp_path / "bad.safetensors")
    assert result.exit_code == 1 and result.stderr.startswith("Error: ")


def test_cosine_column_never_rounds_a_difference_to_one():
    from tclip.cli.render.diff import _cosine

    assert _cosine(1.0) == "1"
    assert _cosine(0.9999999952226214) == "0.999999995"
    assert _cosine(0.5) == "0.500000"
    assert _cosine(-1.0) == "-1"
    assert _cosine(float("nan")) == "nan" and _cosine(None) == "—"
    assert float(_cosine(1 - 2 ** -52)) != 1.0



@pytest.mark.parametrize("save", [np.savez, np.savez_compressed], ids=["stored", "deflated"])
def test_what_is_not_numbers_in_an_npz_is_compared_exactly_and_never_unpickled(tmp_path, save):
    trap = tmp_path / "pickle-ran"
    objects = np.empty(2, dtype=object)
    objects[0], objects[1] = PickleTrap(str(trap)), "x"
    save(tmp_path / "a.npz", w=np.ones(3, np.float32), names=np.array(["fc1", "fc2", "fc3"]), objs=objects)
    save(tmp_path / "same.npz", w=np.ones(3, np.float32), names=np.array(["fc1", "fc2", "fc3"]), objs=objects)
    objects[1] = "y"
    save(tmp_path / "b.npz", w=np.ones(3, np.float32), names=np.array(["fc1", "fcX", "fc3"]), objs=objects)
    assert run("diff", tmp_path / "a.npz", tmp_path / "same.npz").exit_code == 0
    result = run("diff", "--json", tmp_path / "a.npz", tmp_path / "b.npz")
    assert result.exit_code == 3, result.output
    tensors = {t["name"]: t for t in json.loads(result.stdout)["tensors"]}
    assert tensors["names"]["status"] == "compared" and tensors["names"]["outside"] == 1
    assert tensors["objs"]["status"] == "compared" and tensors["objs"]["outside"] == 1
    assert tensors["w"]["outside"] == 0
    assert not trap.exists()


def test_hdf5_string_datasets_are_compared_and_missing_ones_are_differences(tmp_path):
    def write(name, vocab):
        with h5py.File(tmp_path / name, "w") as f:
            f["w"] = np.ones(3, np.float32)
            if vocab is not None:
                f["vocab"] = np.array(vocab)
        return tmp_path / name

    a, same, other, none = (write("a.h5", [b"<pad>", b"the"]), write("s.h5", [b"<pad>", b"the"]),
                            write("o.h5", [b"<pad>", b"a"]), write("n.h5", None))
    assert run("diff", a, same).exit_code == 0
    changed = run("diff", "--json", a, other)
    assert changed.exit_code == 3
    vocab = next(t for t in json.loads(changed.stdout)["tensors"] if t["name"] == "vocab")
    assert vocab["status"] == "compared" and vocab["outside"] == 1 and vocab["elements"] == 2
    missing = run("diff", "--json", a, none)
    assert missing.exit_code == 3
    assert [t["status"] for t in json.loads(missing.stdout)["tensors"] if t["name"] == "vocab"] == ["only in A"]
