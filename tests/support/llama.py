"""A Llama checkpoint's tensor names and small random values for them."""

from __future__ import annotations

import numpy as np

PROJECTIONS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
               "mlp.up_proj", "mlp.down_proj")


def llama_names(layers: int = 24) -> list[str]:
    """A Llama's 219 tensor names (24 layers of 9, the embedding, the final norm, the head)."""
    names = ["model.embed_tokens.weight"]
    for i in range(layers):
        names += [f"model.layers.{i}.{p}.weight" for p in PROJECTIONS]
        names += [f"model.layers.{i}.input_layernorm.weight", f"model.layers.{i}.post_attention_layernorm.weight"]
    return names + ["model.norm.weight", "lm_head.weight"]


def llama_tensors(seed: int = 0, dtype=np.float32, dim: int = 8) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {n: (rng.standard_normal((dim,) if "norm" in n else (dim, dim)) * 0.01).astype(dtype)
            for n in llama_names()}
