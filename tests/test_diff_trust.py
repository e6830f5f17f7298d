"""Issue 20 (2, 3, 4, 11) and 21 (7, 10, 11): a diff never says ``same`` over what it did not
compare; integers compare exactly; metadata and attributes are compared; ``--map`` is
checked, suggested when nothing pairs, and matched in linear time."""

from __future__ import annotations

import json

import numpy as np
import pytest
from click.testing import CliRunner
from formats_helpers import safetensors_bytes

from tclip.cli import cli


def run(*args):
    return CliRunner().invoke(cli, [str(a) for a in args], env={"COLUMNS": "80"})


def st(path, tensors, metadata=None):
    path.write_bytes(safetensors_bytes(tensors, metadata))
    return path


# ------------------------------------------------------------------ 21.10 tolerances are usage errors


@pytest.mark.parametrize("option, value", [("--rtol", "-1"), ("--atol", "-1"), ("--rtol", "nan"),
                                           ("--atol", "-1e-300"), ("--rtol", "inf")])
def test_bad_tolerances_are_usage_errors(tmp_path, option, value):
    a = st(tmp_path / "a.safetensors", {"w": np.ones(3, np.float32)})
    result = run("diff", option, value, a, a)
    assert result.exit_code == 2, result.output
    assert f"Invalid value for '{option}'" in result.stderr and "internal error" not in result.output
