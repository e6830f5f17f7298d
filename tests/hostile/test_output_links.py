"""An output path that names another hard link of the input: the atomic rename replaces that
directory entry only, the input's name keeps the old file, so the output is allowed (only an
output that is the input's own entry, or a symlink to it, would replace the input)."""

from __future__ import annotations

import os

import h5py
import numpy as np
import pytest

from support.cli import run


RNG = np.random.default_rng(14)


def _write(path, array):
    if path.suffix == ".npy":
        np.save(path, array)
    else:
        with h5py.File(path, "w") as f:
            f["model.layers.17.self_attn.k_proj.weight"] = array


def _read(path):
    if path.suffix == ".npy":
        return np.load(path)
    with h5py.File(path, "r") as f:
        return f["model.layers.17.self_attn.k_proj.weight"][()]


@pytest.mark.parametrize("suffix", [".npy", ".h5"])
def test_an_output_that_is_another_hard_link_of_the_input_is_written(tmp_path, suffix):
    weight = (RNG.standard_normal((8, 4)) * 3).astype(np.float32)
    source, twin = tmp_path / f"in{suffix}", tmp_path / f"hl{suffix}"
    _write(source, weight)
    os.link(source, twin)
    before = source.read_bytes()
    result = run("norm", "--clip", "1", "-o", twin, "--force", source)
    assert result.exit_code == 0, result.output
    assert source.read_bytes() == before and os.stat(source).st_nlink == 1  # the input, untouched, alone
    assert os.stat(twin).st_ino != os.stat(source).st_ino
    np.testing.assert_allclose(_read(twin), weight / np.linalg.norm(weight.astype(np.float64)), rtol=1e-6)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([source.name, twin.name])


def test_an_output_that_is_a_symlink_to_the_input_is_still_refused(tmp_path):
    source = tmp_path / "in.npy"
    np.save(source, np.full(4, 3.0, np.float32))
    (tmp_path / "link.npy").symlink_to(source)
    before = source.read_bytes()
    result = run("norm", "--clip", "1", "-o", tmp_path / "link.npy", "--force", source)
    assert result.exit_code == 1 and "would replace the input" in result.stderr
    assert source.read_bytes() == before and (tmp_path / "link.npy").is_symlink()
