"""``report --summary --of grads|drift``: gradient norms from AdamW state, checked against a real
training run (torch in a subprocess: tests/support/history_run.py) and the formulas, and drift against
exact arithmetic."""

from __future__ import annotations

import importlib.util
import json
import math
import subprocess
import sys

import numpy as np
import pytest

import support
from support.cli import run


needs_torch = pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="torch writes the training run")
BETA2 = float(np.float32(0.95))  # as torch's float32 kernels multiply by it
SPIKE_STEP, STEPS, FROZEN_UNTIL = 7, 12, 4


@pytest.fixture(scope="module")
def training(tmp_path_factory):
    out = tmp_path_factory.mktemp("run")
    script = support.TESTS / "support" / "history_run.py"
    done = subprocess.run([sys.executable, str(script), str(out)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    return out, json.loads((out / "truth.json").read_text())


def lines(output: str) -> list[dict]:
    return [json.loads(line) for line in output.splitlines() if line.startswith("{")]


def ema(v: float, t: float) -> float:
    return v / (1 - BETA2 ** t)


def interval(v1: float, t1: float, v2: float, t2: float) -> float:
    k = t2 - t1
    return (v2 - BETA2 ** k * v1) / (1 - BETA2 ** k)


def close(a: float, b: float, rel: float) -> bool:
    return abs(a - b) <= rel * abs(b)


@needs_torch
@pytest.mark.slow  # the module's training run: torch in a child process
@pytest.mark.parametrize("layout", ["pt", "hf", "named", "flat"])
def test_grads_match_the_formulas_for_every_checkpoint_and_interval(training, layout):
    out, truth = training
    files = [str(out / "hf" / "checkpoint-*")] if layout == "hf" else sorted((out / layout).glob("step_*.pt"))
    result = run("report", "--summary", "--of", "grads", "--json", *files)
    assert result.exit_code == 0, result.output + result.stderr
    items = lines(result.output)
    assert [i["step"] for i in items] == [c["step"] for c in truth["checkpoints"]]
    checked = 0
    for c, item in enumerate(items):
        by_key = {str(d["key"]): d for d in item["tensors"]}
        assert len(by_key) == len(truth["checkpoints"][c]["state"])  # a frozen parameter has no state yet
        for name, state in truth["checkpoints"][c]["state"].items():
            d = by_key[str(state["key"]) if layout in ("pt", "hf") else name]
            assert d["step"] == state["step"] and d["beta2"] == BETA2
            assert close(d["sum_exp_avg_sq"], state["sum"], 1e-15)
            assert close(d["ema_sq"], ema(state["sum"], state["step"]), 1e-9)
            assert close(d["ema_norm"], math.sqrt(ema(state["sum"], state["step"])), 1e-9)
            before = truth["checkpoints"][c - 1]["state"].get(name, {"sum": 0.0, "step": 0.0}) if c else \
                {"sum": 0.0, "step": 0.0}
            expected = interval(before["sum"], before["step"], state["sum"], state["step"])
            span = d["interval"]
            assert (span["after_step"], span["to_step"]) == (before["step"], state["step"])
            if expected >= 0:
                assert close(span["mean_sq"], expected, 1e-9), (name, c)
            else:
                assert span["mean_sq"] == 0 and span["clamped_at_zero"] and not span["trusted"]
            checked += 1
    assert checked == 6 * 4 - 1  # 0.bias has no state at step 3
    assert by_key[str(truth["checkpoints"][-1]["state"]["0.bias"]["key"]) if layout in ("pt", "hf") else "0.bias"][
        "step"] == STEPS - FROZEN_UNTIL  # its own step, not the checkpoint's


@needs_torch
@pytest.mark.slow  # the module's training run: torch in a child process
def test_grads_agree_with_the_true_gradient_norms_within_their_error_bound(training):
    """sqrt(S_t) is the bias-corrected EMA of the true ||g||^2, and each interval the weighted
    mean of the true ||g_s||^2 over its steps, to within what float32 state allows (the
    interval's conditioning x 4e-7, which the JSON gives)."""
    out, truth = training
    items = lines(run("report", "--summary", "--of", "grads", "--json", *sorted((out / "pt").glob("*.pt"))).output)
    for item in items:
        for d in item["tensors"]:
            name = d["name"].removeprefix("model.")
            grad_sq = [g[name] for g in truth["grad_sq"] if name in g]  # its own steps (frozen ones have none)
            t1, t2 = int(d["interval"]["after_step"]), int(d["step"])
            true_ema = sum((1 - BETA2) * BETA2 ** (t2 - s) * grad_sq[s - 1] for s in range(1, t2 + 1))
            assert close(d["ema_sq"], true_ema / (1 - BETA2 ** t2), 2e-6), (name, t2)
            weights = [BETA2 ** (t2 - s) for s in range(t1 + 1, t2 + 1)]
            true_mean = sum(w * grad_sq[s - 1] for w, s in zip(weights, range(t1 + 1, t2 + 1))) / sum(weights)
            bound = max(d["interval"]["conditioning"] * 4e-7, 2e-6)
            assert abs(d["interval"]["mean_sq"] - true_mean) <= bound * true_mean, (name, t2)


@needs_torch
@pytest.mark.slow  # the module's training run: torch in a child process
def test_the_spike_is_pinned_to_its_interval_and_layer(training):
    out, _ = training
    result = run("report", "--summary", "--of", "grads", *sorted((out / "pt").glob("*.pt")))
    assert result.exit_code == 0, result.output
    table = result.output.split("farthest from their tensor's median")[1].splitlines()
    first = table[3].split()
    # the step-7 spike lies in the interval (6, 9]: the checkpoint step_9, layer 2.bias
    assert first[:2] == ["model.2.bias", "step_9"], result.output
    assert "too badly conditioned" in result.stderr  # the interval right after it is flagged


@needs_torch
@pytest.mark.slow  # the module's training run: torch in a child process
def test_trainer_checkpoints_name_parameters_only_where_unambiguous(training):
    """model.safetensors lists its tensors sorted by name, not in module order: only parameters
    whose shape no other tensor has are named; the others keep the optimizer's number."""
    out, truth = training
    items = lines(run("report", "--summary", "--of", "grads", "--json", str(out / "hf" / "checkpoint-*")).output)
    names = {str(d["key"]): d["name"] for d in items[0]["tensors"]}
    keys = {name: str(s["key"]) for name, s in truth["checkpoints"][0]["state"].items()}
    assert names[keys["0.weight"]] == "0.weight" and names[keys["2.weight"]] == "2.weight"
    assert names[keys["2.bias"]] == "2.bias"
    assert names[keys["1.bias"]] == f"param {keys['1.bias']} (8)"  # three tensors of shape (8,)
    assert "sorted by name" in " ".join(items[0]["notes"])
    alone = lines(run("report", "--summary", "--of", "grads", "--json",
                      str(out / "hf" / "checkpoint-*" / "optimizer.pt")).output)
    assert [d["name"] for d in alone[0]["tensors"]] == [d["name"] for d in items[0]["tensors"]]  # the model beside it


@needs_torch
@pytest.mark.slow  # the module's training run: torch in a child process
def test_single_file_checkpoints_name_every_parameter_by_module_order(training):
    out, truth = training
    items = lines(run("report", "--summary", "--of", "grads", "--json", *sorted((out / "pt").glob("*.pt"))).output)
    keys = {str(d["key"]): d["name"] for d in items[-1]["tensors"]}
    assert keys == {str(s["key"]): f"model.{n}" for n, s in truth["checkpoints"][-1]["state"].items()}
    named = lines(run("report", "--summary", "--of", "grads", "--json",
                      *sorted((out / "named").glob("*.pt"))).output)
    assert {d["name"] for d in named[-1]["tensors"]} == set(truth["checkpoints"][-1]["state"])


@needs_torch
@pytest.mark.slow  # the module's training run: torch in a child process
def test_an_optimizer_that_is_not_adam_is_said_in_one_line(training):
    out, _ = training
    result = run("report", "--summary", "--of", "grads", *sorted((out / "sgd").glob("*.pt")))
    assert result.exit_code == 0, result.output
    assert result.stderr.count("not an Adam-like optimizer") == 1, result.stderr
    assert "Traceback" not in result.stderr


@needs_torch
@pytest.mark.slow  # the module's training run: torch in a child process
def test_drift_is_exact_and_a_gate(training):
    out, truth = training
    files = sorted((out / "pt").glob("*.pt"), key=lambda p: int(p.stem.split("_")[1]))
    items = lines(run("report", "--summary", "--of", "drift", "--json", *files).output)
    assert [i["file"] for i in items] == [str(f) for f in files]
    assert items[0]["tensors"] == []
    for item, expected in zip(items[1:], truth["drift"]):
        got = {d["name"].removeprefix("model."): d["drift"] for d in item["tensors"]}
        assert got.keys() == expected.keys()  # the weights only: no optimizer state
        for name, value in expected.items():
            assert close(got[name], value, 1e-12), name
    largest = max((v, n, i) for i, d in enumerate(truth["drift"]) for n, v in d.items())
    gate = run("report", "--summary", "--of", "drift", "--max-drift", largest[0] * 0.999, *files)
    assert gate.exit_code == 3, gate.output
    assert f"model.{largest[1]}: changed by" in gate.stderr
    assert f"between {files[largest[2]]} and {files[largest[2] + 1]}" in gate.stderr
    assert run("report", "--summary", "--of", "drift", "--max-drift", largest[0] * 1.001, *files).exit_code == 0


def test_history_options_need_summary():
    for args in (["--of", "grads"], ["--plot", "x.svg"], ["--heatmap"], ["--max-drift", "1"]):
        result = run("report", *args, "x.npy")
        assert result.exit_code == 2 and "--summary" in result.stderr, args
    result = run("report", "--summary", "--max-drift", "1", "x.npy")
    assert result.exit_code == 2 and "--of drift" in result.stderr
    result = run("report", "--summary", "--plot", "x.pdf", "x.npy")
    assert result.exit_code == 2 and ".svg, .html or .png" in result.stderr
    for args in (["--max-norm", "1"], ["--axes", "1"], ["--ord", "inf"], ["--across-files"], ["--sort", "norm"]):
        result = run("report", "--summary", "--of", "grads", *args, "x.npy")
        assert result.exit_code == 2 and "--of norms, not --of grads" in result.stderr, args


def test_keras_optimizer_variables_are_said_not_read_in_one_line():
    keras = support.FIXTURES / "keras"
    result = run("report", "--summary", "--of", "grads", keras / "adam.weights.h5", keras / "adam_legacy.h5")
    assert result.exit_code == 0 and result.stdout == ""
    assert result.stderr.count("\n") == 1 and "(Keras)" in result.stderr and "not read for gradients" in result.stderr


TIED = """
import sys, torch
torch.manual_seed(0)
class M(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(10, 4)
        self.norm = torch.nn.LayerNorm(4)
        self.head = torch.nn.Linear(4, 10, bias=False)
        self.head.weight = self.embed.weight  # tied
    def forward(self, x):
        return self.head(self.norm(self.embed(x)))
m = M()
opt = torch.optim.AdamW(m.parameters(), betas=(0.9, 0.95))
for step in range(2):
    opt.zero_grad(); m(torch.arange(10)).pow(2).mean().backward(); opt.step()
torch.save({"model": m.state_dict(), "optimizer": opt.state_dict()}, sys.argv[1])
"""


@pytest.mark.slow  # torch in a child process
@needs_torch
def test_tied_weights_are_one_parameter(tmp_path):
    path = tmp_path / "step_2.pt"
    done = subprocess.run([sys.executable, "-c", TIED, str(path)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    items = lines(run("report", "--summary", "--of", "grads", "--json", path).output)
    assert [d["name"] for d in items[0]["tensors"]] == ["model.embed.weight", "model.norm.bias", "model.norm.weight"]
    assert items[0]["notes"] == []


@needs_torch
@pytest.mark.slow  # the module's training run: torch in a child process
def test_notes_are_typed(training):
    from tclip.work.history import HistoryNoteKind, grads_grid

    out, _ = training
    pt = grads_grid(sorted((out / "pt").glob("*.pt")))
    assert {n.kind for notes in pt.notes.values() for n in notes} == {HistoryNoteKind.UNTRUSTED_INTERVAL}
    sgd = grads_grid(sorted((out / "sgd").glob("*.pt")))
    assert [n.kind for notes in sgd.notes.values() for n in notes] == [HistoryNoteKind.NO_ADAM_STATE] * 2
    hf = grads_grid(sorted((out / "hf").glob("checkpoint-*/*")))
    assert HistoryNoteKind.NUMBERED in {n.kind for notes in hf.notes.values() for n in notes}


def test_drift_gate_fails_on_what_it_could_not_compare(tmp_path):
    from safetensors.numpy import save_file

    save_file({"a.weight": np.ones((2, 2), np.float32), "b.weight": np.ones(3, np.float32)},
              str(tmp_path / "step_1.safetensors"))
    save_file({"a.weight": np.ones((2, 2), np.float32), "b.weight": np.ones(4, np.float32)},
              str(tmp_path / "step_2.safetensors"))
    result = run("report", "--summary", "--of", "drift", "--max-drift", "0.5", tmp_path / "step_1.safetensors",
                 tmp_path / "step_2.safetensors")
    assert result.exit_code == 3, result.output
    assert "b.weight: was not measured between" in result.stderr
    items = lines(run("report", "--summary", "--of", "drift", "--json", *sorted(tmp_path.glob("*"))).stdout)
    assert items[1]["not_measured"] == [{"name": "b.weight", "why": "shape differs"}]
    assert items[1]["tensors"][0]["drift"] == 0.0
