"""``report --summary --of grads`` over DCP step folders (torchtitan's layout: the optimizer state
flattened by name, ``optimizer.param_groups.<fqn>.betas`` saved as objects), written by the real
``torch.distributed.checkpoint`` in a child process; checked against the formulas on the sums torch
itself computes in float64."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from support.cli import run

pytest.importorskip("torch", reason="torch writes the DCP folders (the test-torch extra)")
pytestmark = pytest.mark.slow  # torch writes a run of DCP step folders in a child process

CHILD = textwrap.dedent("""
    import json, sys, warnings
    import torch, torch.nn as nn, torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                         get_optimizer_state_dict)
    warnings.simplefilter("ignore")
    root = sys.argv[1]
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.95))
    expected = {}
    for step in range(1, 7):
        loss = model(torch.randn(32, 8)).pow(2).mean() * (1000 if step == 5 else 1)
        opt.zero_grad(); loss.backward(); opt.step()
        if step % 2:
            continue
        optimizer = get_optimizer_state_dict(model, opt,
                                             options=StateDictOptions(flatten_optimizer_state_dict=True))
        state = dict(get_model_state_dict(model))
        state.update({"optimizer." + k: v for k, v in optimizer.items()})
        dcp.save(state, checkpoint_id=f"{root}/step-{step}")
        expected[f"step-{step}"] = {
            k[len("optimizer.state."):-len(".exp_avg_sq")]: [float(v.double().sum()),
                                                             float(optimizer[k[len("optimizer."):-len("exp_avg_sq")] + "step"])]
            for k, v in state.items() if k.endswith(".exp_avg_sq")}
    json.dump(expected, open(f"{root}/expected.json", "w"))
""")


@pytest.fixture(scope="module")
def dcp_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    root = tmp_path_factory.mktemp("dcp_history")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(OMP_NUM_THREADS="1")
    subprocess.run([sys.executable, "-c", CHILD, str(root)], check=True, env=env, timeout=300, capture_output=True)
    return root, json.loads((root / "expected.json").read_text())


def test_grads_from_dcp_step_folders_follow_the_formulas(dcp_run: tuple[Path, dict]) -> None:
    root, expected = dcp_run
    result = run("report", "--summary", "--of", "grads", "--json", str(root / "step-*"))
    assert result.exit_code == 0, result.output
    rows = [json.loads(line) for line in result.stdout.splitlines()]
    assert [r["label"] for r in rows] == ["step-2", "step-4", "step-6"]
    beta2 = 0.949999988079071  # 0.95 as torch's float32 kernels hold it
    previous: dict[str, tuple[float, float]] = {}
    for row in rows:
        sums = expected[row["label"]]
        assert sorted(t["name"] for t in row["tensors"]) == sorted(sums) == ["0.bias", "0.weight", "2.bias",
                                                                             "2.weight"]
        for t in row["tensors"]:
            v, step = sums[t["name"]]
            assert t["beta2"] == beta2 and t["step"] == step
            assert t["sum_exp_avg_sq"] == pytest.approx(v, rel=1e-12)
            assert t["ema_norm"] == pytest.approx(math.sqrt(v / (1 - beta2 ** step)), rel=1e-9)
            if t["name"] in previous:
                v1, t1 = previous[t["name"]]
                decay = beta2 ** (step - t1)
                assert t["interval"]["norm"] == pytest.approx(math.sqrt((v - decay * v1) / (1 - decay)), rel=1e-9)
            previous[t["name"]] = (v, step)
    # the x1000 loss at step 5 lands in the interval (4, 6] of every tensor
    last = {t["name"]: t["interval"]["norm"] for t in rows[2]["tensors"]}
    before = {t["name"]: t["interval"]["norm"] for t in rows[1]["tensors"]}
    assert all(last[name] > 100 * before[name] for name in last)
