"""A small training run for the history tests: AdamW for real (torch, in a subprocess).

``python history_run.py OUT`` trains a 3-layer model for 12 steps with two param groups
(decay / no decay, as Hugging Face Trainer makes them), multiplies one small layer's
gradient (``2.bias``) by 1000 at step 7, keeps ``0.bias`` frozen (no gradient, so no
state and a lagging step count) until step 4, and writes every 3 steps:

- ``OUT/pt/step_N.pt``: ``torch.save({"model": state_dict, "optimizer": opt.state_dict()})``;
- ``OUT/hf/checkpoint-N/``: ``model.safetensors`` + ``optimizer.pt`` (Trainer style);
- ``OUT/named/step_N.pt``: the optimizer state keyed by parameter name
  (``torch.distributed.checkpoint.state_dict.get_optimizer_state_dict``);
- ``OUT/flat/step_N.pt``: the same flattened (``state.<name>.exp_avg_sq``,
  ``param_groups.<name>.betas``), as DCP stores it;
- ``OUT/sgd/step_N.pt``: the same with SGD + momentum (not Adam-like);
- ``OUT/truth.json``: the true per-step squared gradient norms, each checkpoint's
  optimizer state as the formulas need it (sum of exp_avg_sq summed exactly, each
  parameter's own step, beta2), and the drift of every weight between files in float64.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

SPIKE_STEP, SPIKE_FACTOR, STEPS, EVERY, FROZEN_UNTIL = 7, 1000.0, 12, 3, 4


def model_and_groups(seed: int):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.LayerNorm(8), torch.nn.Linear(8, 2))
    decay = [p for n, p in model.named_parameters() if n.endswith("weight") and not n.startswith("1.")]
    other = [p for n, p in model.named_parameters() if not (n.endswith("weight") and not n.startswith("1."))]
    return model, decay, other


def main(out: Path) -> None:
    model, decay, other = model_and_groups(0)
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.01}, {"params": other, "weight_decay": 0.0}],
                            lr=1e-2, betas=(0.9, 0.95))
    ids = {id(p): i for i, p in enumerate(decay + other)}
    names = {id(p): n for n, p in model.named_parameters()}
    truth: dict = {"grad_sq": [], "checkpoints": [], "drift": []}
    previous = None
    for step in range(1, STEPS + 1):
        x = torch.randn(16, 4)
        loss = model(x).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        if step == SPIKE_STEP:
            model[2].bias.grad.mul_(SPIKE_FACTOR)
        if step <= FROZEN_UNTIL:
            model[0].bias.grad = None  # frozen: AdamW skips it, so its own step count lags the run's
        truth["grad_sq"].append({n: math.fsum(p.grad.double().pow(2).flatten().tolist())
                                 for n, p in model.named_parameters() if p.grad is not None})
        opt.step()
        if step % EVERY:
            continue
        state = {}
        for p in decay + other:
            if p not in opt.state:
                continue
            s = opt.state[p]
            state[names[id(p)]] = {"key": ids[id(p)], "step": float(s["step"]),
                                   "sum": math.fsum(s["exp_avg_sq"].double().flatten().tolist())}
        truth["checkpoints"].append({"step": step, "state": state})
        weights = {n: t.detach().clone().double() for n, t in model.state_dict().items()}
        if previous is not None:
            truth["drift"].append({n: float(torch.linalg.vector_norm(weights[n] - previous[n])
                                            / torch.linalg.vector_norm(previous[n])) for n in weights})
        previous = weights
        (out / "pt").mkdir(parents=True, exist_ok=True)
        torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, out / "pt" / f"step_{step}.pt")
        folder = out / "hf" / f"checkpoint-{step}"
        folder.mkdir(parents=True, exist_ok=True)
        save_file({k: v.contiguous() for k, v in model.state_dict().items()}, folder / "model.safetensors")
        torch.save(opt.state_dict(), folder / "optimizer.pt")
        (out / "named").mkdir(parents=True, exist_ok=True)
        torch.save({"model": model.state_dict(), "optimizer": get_optimizer_state_dict(model, opt)},
                   out / "named" / f"step_{step}.pt")
        (out / "flat").mkdir(parents=True, exist_ok=True)
        flat = get_optimizer_state_dict(model, opt, options=StateDictOptions(flatten_optimizer_state_dict=True))
        torch.save({"model": model.state_dict(), "optim": flat}, out / "flat" / f"step_{step}.pt")
    sgd_model, _, _ = model_and_groups(1)
    sgd = torch.optim.SGD(sgd_model.parameters(), lr=1e-2, momentum=0.9)
    (out / "sgd").mkdir(parents=True, exist_ok=True)
    for step in range(1, 7):
        sgd.zero_grad()
        sgd_model(torch.randn(16, 4)).pow(2).mean().backward()
        sgd.step()
        if step % EVERY == 0:
            torch.save({"model": sgd_model.state_dict(), "optimizer": sgd.state_dict()},
                       out / "sgd" / f"step_{step}.pt")
    (out / "truth.json").write_text(json.dumps(truth))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
