"""Types that hold: mypy passes on the package with the project's configuration, and axes
are parsed once, where a caller gives them, into one typed value (``tclip.core.stats.Axes``)."""

from __future__ import annotations

import importlib.util
import pathlib
import subprocess
import sys

import numpy as np
import pytest

from tclip.core.modes import NormClip, stats_axes
from tclip.core.stats import parse_axes

ROOT = pathlib.Path(__file__).resolve().parents[2]


@pytest.mark.slow  # (20-30 s without mypy's cache; CI also runs python -m mypy before the tests)
@pytest.mark.skipif(importlib.util.find_spec("mypy") is None, reason="mypy (the test extra) is not installed")
def test_mypy_passes_with_the_projects_configuration():
    # no arguments: pyproject.toml's [tool.mypy] names what is checked, as CI runs it
    done = subprocess.run([sys.executable, "-m", "mypy"], cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "Success: no issues found" in done.stdout


@pytest.mark.parametrize(("given", "parsed"), [
    (None, None),
    (1, (1,)),
    (-1, (-1,)),
    ([1, 0], (1, 0)),
    ((), ()),
    (np.array([0, -2]), (0, -2)),
    (np.int64(2), (2,)),
    ([np.int32(1), 3], (1, 3)),
])
def test_parse_axes_gives_a_tuple_of_python_ints(given, parsed):
    result = parse_axes(given)
    assert result == parsed
    assert result is None or all(type(a) is int for a in result)


@pytest.mark.parametrize("given", [[1.0], [True], "1", [None], [1, "2"]])
def test_parse_axes_refuses_what_is_not_integers(given):
    with pytest.raises(TypeError, match="axes: expected integers"):
        parse_axes(given)


def test_norm_clip_keeps_its_axes_parsed():
    mode = NormClip(2.0, axes=[1, -1])  # a list, as Python callers and TensorFlow write it
    assert mode.axes == (1, -1)
    assert mode == NormClip(2.0, axes=(1, -1))
    assert hash(mode) == hash(NormClip(2.0, axes=(1, -1)))  # frozen and hashable: no list inside
    assert NormClip(2.0, axes=1) == NormClip(2.0, axes=[1])
    assert stats_axes(mode, 3) == (1, 2)


def test_norm_clip_refuses_axes_that_are_not_integers_when_made():
    with pytest.raises(TypeError, match="axes: expected integers, got 0.5"):
        NormClip(2.0, axes=[0.5])


@pytest.mark.parametrize("entry", ["tclip.report", "report_file"])
def test_report_parses_its_axes_before_reading_anything(tmp_path, entry):
    # only an integer tensor: no tensor reaches the rank check, so the axes are checked where given
    path = tmp_path / "steps.npz"
    np.savez(path, step=np.array([7], np.int64))
    import tclip
    from tclip.work.clip import report_file

    if entry == "tclip.report":
        def report(path, axes):  # as a set (across files): report_set's path, not report_file's
            return tclip.report(path, axes=axes, across_files=True)
    else:
        report = report_file
    with pytest.raises(TypeError, match="axes: expected integers, got 'x'"):
        report(path, axes=["x"])
    assert report(path, axes=np.array([1])).to_json()["params"]["axes"] == [1]
