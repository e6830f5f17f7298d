"""A tiny llama-shaped model as GGUF at three levels, for README's GGUF example.

    python tests/support/gguf_examples.py DIR

writes ``DIR/tinyllama-f16.gguf`` (F16 weights, F32 norms, as llama.cpp's converter keeps
them), ``DIR/tinyllama-q8_0.gguf`` and ``DIR/tinyllama-q4_0.gguf`` (the same weights
quantized by the ``gguf`` package, llama.cpp's Python quantizer; norms stay F32), and
``DIR/tinyllama-q8_0-nan.gguf``: the Q8_0 file with one block scale of ``blk.1.ffn_down.weight``
made NaN, as published files have shipped. Seeded: the same bytes every time.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from support import gguf_helpers as gh  # noqa: E402

HIDDEN, FFN, VOCAB, LAYERS = 256, 768, 2048, 2
F16, Q8_0, Q4_0 = 1, 8, 2


def weights() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(2026)
    out = {"token_embd.weight": rng.standard_normal((VOCAB, HIDDEN)).astype(np.float32) * np.float32(0.5)}
    for layer in range(LAYERS):
        p = f"blk.{layer}."
        out[p + "attn_norm.weight"] = (1 + 0.1 * rng.standard_normal(HIDDEN)).astype(np.float32)
        for name, shape in (("attn_q", (HIDDEN, HIDDEN)), ("attn_k", (HIDDEN, HIDDEN)), ("attn_v", (HIDDEN, HIDDEN)),
                            ("attn_output", (HIDDEN, HIDDEN)), ("ffn_gate", (FFN, HIDDEN)), ("ffn_up", (FFN, HIDDEN)),
                            ("ffn_down", (HIDDEN, FFN))):
            out[p + name + ".weight"] = rng.standard_normal(shape).astype(np.float32) * np.float32(0.02)
        out[p + "ffn_norm.weight"] = (1 + 0.1 * rng.standard_normal(HIDDEN)).astype(np.float32)
    out["output_norm.weight"] = (1 + 0.1 * rng.standard_normal(HIDDEN)).astype(np.float32)
    out["output.weight"] = rng.standard_normal((VOCAB, HIDDEN)).astype(np.float32) * np.float32(0.02)
    return out


def write(path: Path, kind: int, nan_block: tuple[str, int] | None = None) -> None:
    import gguf

    tensors = []
    for name, array in weights().items():
        if array.ndim == 1:
            tensors.append(gh.Tensor(name, array.shape, 0, array.astype("<f4").tobytes()))
            continue
        if kind == F16:
            raw = array.astype("<f2").tobytes()
        else:
            raw = bytearray(gguf.quants.quantize(array, gguf.GGMLQuantizationType(kind)).tobytes())
            if nan_block is not None and nan_block[0] == name:
                at = nan_block[1] * 34
                raw[at:at + 2] = np.array([np.nan], "<f2").tobytes()
            raw = bytes(raw)
        tensors.append(gh.Tensor(name, array.shape, kind, raw))
    metadata = [("general.architecture", gh.STRING, "llama"), ("general.name", gh.STRING, "tinyllama"),
                ("llama.block_count", gh.UINT32, LAYERS), ("llama.embedding_length", gh.UINT32, HIDDEN),
                ("tokenizer.ggml.tokens", gh.ARRAY, gh.Array(gh.STRING, [f"<tok{i}>" for i in range(VOCAB)]))]
    gh.write_gguf(path, gh.GgufSpec(metadata=metadata, tensors=tensors))


def build(root: Path) -> None:
    root.mkdir(parents=True, exist_ok=True)
    write(root / "tinyllama-f16.gguf", F16)
    write(root / "tinyllama-q8_0.gguf", Q8_0)
    write(root / "tinyllama-q4_0.gguf", Q4_0)
    # row 3, block 7 of a 256 x 768 Q8_0 weight (24 blocks a row)
    write(root / "tinyllama-q8_0-nan.gguf", Q8_0, ("blk.1.ffn_down.weight", 3 * 24 + 7))


if __name__ == "__main__":
    build(Path(sys.argv[1]))
