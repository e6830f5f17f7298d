"""``report --max-norm``: the gate's verdict as data.

``--json`` carries ``verdict`` (passed, failed, incomplete) and typed ``reasons``, so a
script never reads "check failed" in a warning; the exit status comes from the same
decision (3 exactly when a verdict is not passed); the Python report holds it as ``gate``."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from support.cli import run
from support.formats_helpers import safetensors_bytes
from tclip.work.clip import report_file

K = "model.layers.17.self_attn.k_proj.weight"
Q = "model.layers.17.self_attn.q_proj.weight"
NORM = "model.layers.17.input_layernorm.weight"


def write(path: Path, tensors: dict[str, np.ndarray]) -> Path:
    path.write_bytes(safetensors_bytes(tensors))
    return path


def small() -> dict[str, np.ndarray]:
    return {K: np.full((8, 8), 0.01, np.float32), Q: np.full((8, 8), 0.02, np.float32),
            NORM: np.ones(8, np.float32)}


def with_f4(path: Path, big: bool = False) -> Path:
    """A safetensors file whose first tensor is F4 (tclip cannot measure it)."""
    value = 1e4 if big else 0.5
    header = json.dumps({"lm_head.weight": {"dtype": "F4", "shape": [4], "data_offsets": [0, 2]},
                         NORM: {"dtype": "F32", "shape": [2], "data_offsets": [2, 10]}}).encode()
    header += b" " * (-len(header) % 8)
    path.write_bytes(len(header).to_bytes(8, "little") + header + b"\x12\x34" + np.full(2, value, np.float32).tobytes())
    return path


def case(tmp_path: Path, name: str) -> tuple[list[str], str, list[dict]]:
    """Options and file of a case, and the reasons expected (kind, tensor, and what else is checked)."""
    if name == "passes":
        return [], write(tmp_path / "m.safetensors", small()), []
    if name == "global":
        tensors = small()
        tensors[K] = np.full((8, 8), 50.0, np.float32)  # norm 400
        return [], write(tmp_path / "m.safetensors", tensors), [
            {"kind": "max_norm", "tensor": None, "value": pytest.approx(400.0, rel=1e-3), "limit": 100.0,
             "slice": None, "largest": {"name": K, "norm": pytest.approx(400.0)}}]
    if name == "row":
        tensors = small()
        tensors[Q][3] = 60.0  # row 3: norm 169.7
        return ["--axes", "1"], write(tmp_path / "m.safetensors", tensors), [
            {"kind": "max_norm", "tensor": Q, "value": pytest.approx(60 * 8 ** 0.5), "limit": 100.0,
             "slice": {"kind": "row", "index": [3]}}]
    if name == "nan":
        tensors = small()
        tensors[NORM][2] = np.nan
        tensors[K][0, 0] = np.inf
        return ["--axes", "1"], write(tmp_path / "m.safetensors", tensors), [
            {"kind": "nonfinite", "tensor": NORM, "nan": 1, "inf": 0},
            {"kind": "nonfinite", "tensor": K, "nan": 0, "inf": 1},
            {"kind": "max_norm", "tensor": K, "value": "inf", "slice": {"kind": "row", "index": [0]}}]
    if name == "unmeasured":
        return [], with_f4(tmp_path / "f4.safetensors"), [
            {"kind": "unmeasured", "tensor": "lm_head.weight", "why": "F4 [4] (not supported) is not numeric"}]
    assert name == "unmeasured and over"
    return [], with_f4(tmp_path / "f4.safetensors", big=True), [
        {"kind": "unmeasured", "tensor": "lm_head.weight"},
        {"kind": "max_norm", "tensor": None, "value": pytest.approx(1e4 * 2 ** 0.5)}]


VERDICTS = {"passes": "passed", "global": "failed", "row": "failed", "nan": "failed", "unmeasured": "incomplete",
            "unmeasured and over": "failed"}


@pytest.mark.parametrize("name", list(VERDICTS))
def test_json_verdict_and_exit_status_agree(tmp_path, name):
    options, path, expected = case(tmp_path, name)
    result = run("report", "--max-norm", "100", "--json", *options, path)
    data = json.loads(result.stdout)
    assert data["verdict"] == VERDICTS[name], data
    assert result.exit_code == (0 if data["verdict"] == "passed" else 3), result.output
    assert len(data["reasons"]) == len(expected), data["reasons"]
    for reason, wanted in zip(data["reasons"], expected):
        assert reason["file"] == str(path)
        for key, value in wanted.items():
            assert reason[key] == value, (key, reason)
    # The table, -q and --json runs exit alike; the warning is there exactly when it did not pass.
    for extra in ([], ["-q"]):
        plain = run("report", "--max-norm", "100", *extra, *options, path)
        assert plain.exit_code == result.exit_code
        assert ("check failed" in plain.stderr) == (data["verdict"] != "passed")


def test_no_gate_no_verdict(tmp_path):
    data = json.loads(run("report", "--json", write(tmp_path / "m.safetensors", small())).stdout)
    assert "verdict" not in data and "reasons" not in data


def test_each_file_has_its_verdict_and_the_run_exits_3_if_one_did_not_pass(tmp_path):
    good = write(tmp_path / "step_1.safetensors", small())
    tensors = small()
    tensors[K][0, 0] = np.nan
    bad = write(tmp_path / "step_2.safetensors", tensors)
    result = run("report", "--max-norm", "100", "--json", good, bad)
    verdicts = [json.loads(line)["verdict"] for line in result.stdout.splitlines()]
    assert verdicts == ["passed", "failed"] and result.exit_code == 3
    summary = run("report", "--summary", "--max-norm", "100", "--json", good, bad)
    objects = [json.loads(line) for line in summary.stdout.splitlines()]
    assert [o["verdict"] for o in objects] == ["passed", "failed"] and summary.exit_code == 3
    assert objects[1]["reasons"][0] == {"kind": "nonfinite", "file": str(bad), "tensor": K, "nan": 1, "inf": 0}
    assert objects[1]["reasons"][1]["kind"] == "max_norm" and objects[1]["reasons"][1]["value"] == "nan"
    alone = run("report", "--summary", "--max-norm", "100", "--json", good)
    assert json.loads(alone.stdout)["verdict"] == "passed" and alone.exit_code == 0


def test_a_sharded_set_has_one_verdict(tmp_path):
    folder = tmp_path / "ck"
    folder.mkdir()
    tensors = small()
    tensors[K] = np.full((8, 8), 50.0, np.float32)
    names = list(tensors)
    for i, part in enumerate([names[:1], names[1:]], 1):
        write(folder / f"model-0000{i}-of-00002.safetensors", {n: tensors[n] for n in part})
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": {
        n: f"model-0000{1 if n in names[:1] else 2}-of-00002.safetensors" for n in names}}))
    result = run("report", "--max-norm", "100", "--json", folder / "model.safetensors.index.json")
    data = json.loads(result.stdout)
    assert data["verdict"] == "failed" and result.exit_code == 3
    assert [r["kind"] for r in data["reasons"]] == ["max_norm"]


def test_the_python_report_holds_the_verdict(tmp_path):
    from tclip.work.gate import GateVerdict, ReasonKind, apply_gate, judge

    tensors = small()
    tensors[K] = np.full((8, 8), 50.0, np.float32)
    path = write(tmp_path / "m.safetensors", tensors)
    report = report_file(path, max_norm=100.0)
    assert report.gate is None
    assert apply_gate(report, 100.0, False, path) is True
    assert report.gate.verdict is GateVerdict.FAILED and not report.gate.passed
    assert [(r.kind, r.tensor) for r in report.gate.reasons] == [(ReasonKind.MAX_NORM, None)]
    assert report.to_json()["verdict"] == "failed"
    assert judge(report_file(path), 1000.0, False).verdict is GateVerdict.PASSED
    assert judge(report, 100.0, False).lines() == ["global norm 400 above 100 (largest: "
                                                   f"{K}, 400)"]
