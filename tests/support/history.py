"""A run of checkpoints with a spike and a NaN, for ``report --summary`` and its pictures."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from safetensors.numpy import save_file

LAYERS, STEPS = 12, 6
SPIKE = ("model.layers.10.mlp.down_proj.weight", 4)   # (tensor, step index): x1000
NAN = ("model.layers.2.self_attn.k_proj.weight", 3)


def names() -> list[str]:
    out = ["model.embed_tokens.weight"]
    for layer in range(LAYERS):
        out += [f"model.layers.{layer}.self_attn.k_proj.weight", f"model.layers.{layer}.mlp.down_proj.weight",
                f"model.layers.{layer}.input_layernorm.weight"]
    return out


def write_run(folder: Path) -> Path:
    """Step files whose tensors keep their norms (+-3% noise), but for a spike and a NaN
    (the ``run_folder`` fixture of tests/history/conftest.py)."""
    rng = np.random.default_rng(0)
    for step in range(STEPS):
        tensors = {}
        for i, name in enumerate(names()):
            values = np.full((4, 4), 0.1 * (i + 1), dtype=np.float32) * np.float32(1 + 0.03 * rng.standard_normal())
            if (name, step) == SPIKE:
                values *= 1000
            if (name, step) == NAN:
                values[0, 0] = np.nan
            tensors[name] = values
        save_file(tensors, str(folder / f"step_{step * 100}.safetensors"))
    return folder


def files(folder: Path) -> list[Path]:
    return sorted(folder.glob("step_*.safetensors"), key=lambda p: int(p.stem.split("_")[1]))
