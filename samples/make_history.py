"""Write docs/history_grads.svg: a real AdamW run's gradient history as tclip draws it.

    python samples/make_history.py      (needs torch; deterministic)

A 6-layer toy model (attention-like and MLP projections, a norm per layer) trains
for 40 steps with AdamW(betas=(0.9, 0.95)), saving ``torch.save({"model": ...,
"optimizer": ...})`` every 2 steps. At step 23 one layer's gradient is multiplied by
300 (a bad batch that hits one layer), and from step 30 layer 5's MLP gradients
slowly grow. The picture is then drawn by ``tclip report --summary --of grads --plot``.
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
from pathlib import Path

import torch

HERE = Path(__file__).parent
WIDTH, LAYERS, STEPS, EVERY = 16, 6, 40, 2


class Layer(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.input_layernorm = torch.nn.LayerNorm(WIDTH)
        self.q_proj = torch.nn.Linear(WIDTH, WIDTH, bias=False)
        self.v_proj = torch.nn.Linear(WIDTH, WIDTH, bias=False)
        self.up_proj = torch.nn.Linear(WIDTH, 2 * WIDTH, bias=False)
        self.down_proj = torch.nn.Linear(2 * WIDTH, WIDTH, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.input_layernorm(x)
        x = x + self.v_proj(h) * torch.sigmoid(self.q_proj(h))
        return x + self.down_proj(torch.relu(self.up_proj(h)))


class Model(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(Layer() for _ in range(LAYERS))
        self.lm_head = torch.nn.Linear(WIDTH, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return self.lm_head(x)


def main() -> None:
    torch.manual_seed(31)
    model = Model()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, betas=(0.9, 0.95))
    with tempfile.TemporaryDirectory() as folder:
        run = Path(folder) / "run"
        run.mkdir()
        for step in range(1, STEPS + 1):
            x = torch.randn(32, WIDTH)
            loss = (model(x) - x[:, :4]).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            if step == 23:
                model.layers[2].v_proj.weight.grad.mul_(300)
            if step >= 30:
                for p in (model.layers[5].up_proj.weight, model.layers[5].down_proj.weight):
                    p.grad.mul_(1.4 ** (step - 29))
            opt.step()
            if step % EVERY == 0:
                torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, run / f"step_{step}.pt")
        out = HERE.parent / "docs" / "history_grads.svg"
        subprocess.run([sys.executable, "-m", "tclip", "report", "--summary", "--of", "grads", "--plot",
                        "history_grads.svg", "-q", "run/step_*.pt"], cwd=folder, check=True)
        out.write_bytes((Path(folder) / "history_grads.svg").read_bytes())
        text = subprocess.run([sys.executable, "-m", "tclip", "report", "--summary", "--of", "grads",
                               "run/step_*.pt"], cwd=folder, check=True, capture_output=True, text=True)
        print(text.stdout, text.stderr)


if __name__ == "__main__":
    main()
