"""``tclip.summary(..., of="grads"|"drift")``: the same objects and values as
``tclip report --summary --of grads|drift --json``, on a real AdamW run (torch in a
subprocess: tests/support/history_run.py)."""

from __future__ import annotations

import importlib.util
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

import tclip
from tclip.cli import cli

from support import TESTS

needs_torch = pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="torch writes the training run")


@pytest.fixture(scope="module")
def training(tmp_path_factory):
    out = tmp_path_factory.mktemp("run")
    script = TESTS / "support" / "history_run.py"
    done = subprocess.run([sys.executable, str(script), str(out)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    return out, json.loads((out / "truth.json").read_text())


def cli_lines(*args) -> list[dict]:
    result = CliRunner().invoke(cli, [str(a) for a in args])
    assert result.exit_code == 0, result.output
    return [json.loads(line) for line in result.output.splitlines() if line.startswith("{")]


def step_files(folder: Path) -> list[Path]:
    return sorted(folder.glob("step_*.pt"), key=lambda p: int(p.stem.split("_")[1]))


@needs_torch
@pytest.mark.slow  # torch trains the run in a child process
@pytest.mark.parametrize("layout", ["pt", "hf"])
def test_grads_summary_is_the_command_lines_json(training, layout):
    out, truth = training
    paths = [str(out / "hf" / "checkpoint-*")] if layout == "hf" else [str(p) for p in step_files(out / "pt")]
    s = tclip.summary(paths, of="grads")
    expected = cli_lines("report", "--summary", "--of", "grads", "--json", *paths)
    assert json.loads(json.dumps(s.to_json())) == expected
    assert len(expected) == len(truth["checkpoints"]) == 4
    assert s.files == [item["file"] for item in expected]
    records, emas = s.to_records(), s.to_records(ema=True)
    checked = 0
    for record, ema_record, item in zip(records, emas, expected):
        assert (record["file"], record["label"]) == (item["file"], item["label"])
        assert (ema_record["file"], ema_record["label"]) == (item["file"], item["label"])
        by_name = {d["name"]: d for d in item["tensors"]}
        assert set(record) - {"file", "label"} == set(s.tensors)
        for name in s.tensors:
            if name not in by_name:  # the frozen parameter has no state at the first checkpoint
                assert record[name] is None and ema_record[name] is None
                continue
            assert record[name] == by_name[name]["interval"]["norm"]
            assert ema_record[name] == by_name[name]["ema_norm"]
            assert math.isfinite(record[name]) and record[name] >= 0
            checked += 1
    assert checked == 6 * 4 - 1


@needs_torch
@pytest.mark.slow  # torch trains the run in a child process
def test_history_summary_to_pandas(training):
    pytest.importorskip("pandas")
    out, _ = training
    s = tclip.summary([str(p) for p in step_files(out / "pt")], of="grads")
    frame, last = s.to_pandas(), s.to_records()[-1]
    assert list(frame.index) == s.files
    assert [frame.loc[s.files[-1], n] for n in s.tensors] == [last[n] for n in s.tensors]


@needs_torch
@pytest.mark.slow  # torch trains the run in a child process
def test_drift_summary_is_the_command_lines_json_and_exact(training):
    out, truth = training
    files = step_files(out / "pt")
    s = tclip.summary(files, of="drift")
    expected = cli_lines("report", "--summary", "--of", "drift", "--json", *files)
    assert json.loads(json.dumps(s.to_json())) == expected
    records = s.to_records()
    assert [r["file"] for r in records] == [str(f) for f in files]
    assert all(v is None for k, v in records[0].items() if k not in ("file", "label"))
    for record, item, drift in zip(records[1:], expected[1:], truth["drift"]):
        assert {k: v for k, v in record.items() if k not in ("file", "label") and v is not None} == \
            {d["name"]: d["drift"] for d in item["tensors"]}
        got = {k.removeprefix("model."): v for k, v in record.items() if k not in ("file", "label")}
        for name, value in drift.items():
            assert abs(got[name] - value) <= 1e-12 * abs(value), name
    with pytest.raises(ValueError):
        s.to_records(ema=True)


def test_summary_of_an_unknown_quantity_is_a_value_error(tmp_path):
    with pytest.raises(ValueError, match="'grads' or 'drift'"):
        tclip.summary(str(tmp_path / "x.npz"), of="weights")
