"""docs/python.md's API examples run as written (issue 32), on files this test makes."""

from __future__ import annotations

import contextlib
import io
import json
import re
from pathlib import Path

import numpy as np
import pytest

import support
from support import quant_examples as qx

DOC = support.ROOT / "docs" / "python.md"


def _blocks() -> list[str]:
    return re.findall(r"^```python\n(.*?)^```$", DOC.read_text(encoding="utf-8"), re.S | re.M)


def _st(path: Path, tensors: dict[str, np.ndarray]) -> None:
    qx.st_write(str(path), {k: qx.T("F32", v) for k, v in tensors.items()})


def _files(root: Path) -> None:
    rng = np.random.default_rng(7)
    names = [f"model.layers.{i}.mlp.down_proj.weight" for i in (0, 2, 10)]
    model = {n: rng.standard_normal((8, 4)).astype(np.float32) for n in names}
    _st(root / "model.safetensors", model)
    _st(root / "grads.safetensors", {n: v * 3 for n, v in model.items()})
    (root / "sharded").mkdir()
    _st(root / "sharded" / "model-00001-of-00002.safetensors", {names[0]: model[names[0]]})
    _st(root / "sharded" / "model-00002-of-00002.safetensors", {n: model[n] for n in names[1:]})
    weight_map = {n: "model-0000%d-of-00002.safetensors" % (1 if n == names[0] else 2) for n in names}
    (root / "sharded" / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    (root / "runs").mkdir()
    for step in (100, 20):
        np.savez(root / "runs" / f"step-{step}.npz", **{n: v * step for n, v in model.items()})


def test_the_examples_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    blocks = _blocks()
    assert len(blocks) >= 5
    _files(tmp_path)
    monkeypatch.chdir(tmp_path)
    printed = io.StringIO()
    namespace: dict[str, object] = {}
    with contextlib.redirect_stdout(printed):
        for block in blocks:
            exec(compile(block, str(DOC), "exec"), namespace)  # noqa: S102 (our own documentation)
    lines = printed.getvalue().splitlines()
    assert lines[0] == str(["model.layers.0.mlp.down_proj.weight", "model.layers.2.mlp.down_proj.weight",
                            "model.layers.10.mlp.down_proj.weight"])
    assert lines[1] == "(8, 4) float32 float32"
    assert any(line.startswith("False failed ") for line in lines)  # the gate: a norm above 1
    assert [line.split()[0] for line in lines if line.startswith("runs/")] == ["runs/step-20.npz",
                                                                               "runs/step-100.npz"]
    assert "missing.safetensors: no such file" in lines
    assert (tmp_path / "clipped.safetensors").exists()
    assert any(line.startswith("differ [") for line in lines)  # the clip changed every tensor
