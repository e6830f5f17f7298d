"""Issue 20 (1, 2, 11) and 21.10: a ``report --max-norm`` gate never passes over what it did not
measure, fails on every tensor over the limit whatever its rank, and says so in a bounded line."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from click.testing import CliRunner
from formats_helpers import safetensors_bytes

from tclip.cli import cli

LAYERS = 32


def run(*args):
    return CliRunner().invoke(cli, [str(a) for a in args], env={"COLUMNS": "80"})


def llama(path: Path, layers: int = LAYERS, norm_value: float = 1.0) -> Path:
    """Layer norms (rank 1, norm 8 each at the default value) beside small 2-D projections."""
    tensors = {}
    for i in range(layers):
        tensors[f"model.layers.{i}.input_layernorm.weight"] = np.full(64, norm_value, np.float32)
        tensors[f"model.layers.{i}.self_attn.k_proj.weight"] = np.full((8, 8), 0.01, np.float32)
    path.write_bytes(safetensors_bytes(tensors))
    return path


# ------------------------------------------------------------------ 21.10 extreme limits


def test_a_subnormal_limit_is_a_failed_check_not_an_internal_error(tmp_path):
    source = llama(tmp_path / "m.safetensors", layers=2)
    for extra in ([], ["--axes", "1"]):
        result = run("report", "--max-norm", "1e-320", *extra, source)
        assert result.exit_code == 3, result.output
        assert "internal error" not in result.output
        assert "check failed" in result.stderr
