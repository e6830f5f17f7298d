"""Write the sample gradient files in this folder (deterministic; rerun to regenerate).

    python samples/make_samples.py

Each file is written with its format's own library, the way a training script
would save it, and holds something worth seeing in `tclip report`:

- grads.npz: a small MLP's 2-D weights and 1-D biases; fc2's gradient exploded.
- grads.safetensors: bfloat16 and float32 gradients, an int64 step counter and
  ``__metadata__``; one attention projection exploded.
- grads.h5: nested groups with attributes, gzip-compressed chunked datasets.
- grads.npy: one embedding gradient where a few rows exploded.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import h5py
import ml_dtypes
import numpy as np
from safetensors import TensorSpec, serialize

HERE = Path(__file__).parent
RNG = np.random.default_rng(41200)


def gradient(shape: tuple[int, ...], scale: float = 0.01) -> np.ndarray:
    return (RNG.standard_normal(shape) * scale).astype(np.float32)


def make_npz() -> None:
    grads = {
        "fc1.weight": gradient((128, 64)),
        "fc1.bias": gradient((128,)),
        "fc2.weight": gradient((64, 128), scale=2.0),  # the exploded layer
        "fc2.bias": gradient((64,), scale=0.5),
        "fc3.weight": gradient((10, 64)),
        "fc3.bias": gradient((10,)),
    }
    grads["fc2.weight"][3] *= 50  # one row far beyond the others
    np.savez(HERE / "grads.npz", **grads)


def make_safetensors() -> None:
    tensors = {
        "model.embed_tokens.weight": gradient((256, 32), 0.001).astype(ml_dtypes.bfloat16),
        "model.layers.0.self_attn.q_proj.weight": gradient((32, 32), 0.02).astype(ml_dtypes.bfloat16),
        "model.layers.0.self_attn.k_proj.weight": gradient((32, 32), 3.0).astype(ml_dtypes.bfloat16),
        "model.layers.0.mlp.down_proj.weight": gradient((32, 64), 0.02),
        "model.norm.weight": gradient((32,), 0.05),
        "optimizer.step": np.array(41200, dtype=np.int64),
    }
    arrays = {k: np.ascontiguousarray(v) for k, v in tensors.items()}
    specs = {k: TensorSpec(dtype=v.dtype.name, shape=list(v.shape), data_ptr=v.ctypes.data, data_len=v.nbytes)
             for k, v in arrays.items()}
    metadata = {"format": "pt", "step": "41200", "run": "llama-tiny-7"}
    (HERE / "grads.safetensors").write_bytes(_sorted_metadata(bytes(serialize(specs, metadata=metadata))))


def _sorted_metadata(data: bytes) -> bytes:
    """The library writes ``__metadata__`` in a hash map's order, which changes from run to run;
    sort it (same JSON length, same data) so the file is the same every time."""
    (length,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + length])
    header["__metadata__"] = dict(sorted(header["__metadata__"].items()))
    text = json.dumps(header, separators=(",", ":")).encode()
    assert len(text) <= length
    return data[:8] + text + b" " * (length - len(text)) + data[8 + length:]


def make_h5() -> None:
    with h5py.File(HERE / "grads.h5", "w") as f:
        f.attrs["framework"] = "keras"
        f.attrs["step"] = np.int64(900)
        for i, scale in enumerate((0.05, 0.05, 40.0)):
            group = f.create_group(f"encoder/layer{i}")
            group.attrs["units"] = np.int64(64)
            group.create_dataset("kernel", data=gradient((64, 64), scale), chunks=(16, 64),
                                 compression="gzip", compression_opts=4, shuffle=True)
            group.create_dataset("bias", data=gradient((64,), scale / 10))
        f.create_dataset("head/kernel", data=gradient((64, 10), 0.1), chunks=(64, 10), compression="gzip")
        f.create_dataset("vocab", data=np.array([b"<pad>", b"<unk>", b"the"]))


def make_npy() -> None:
    embedding = gradient((1000, 16), 0.001)
    embedding[[7, 42, 901]] *= 5000  # rare tokens with exploded gradients
    np.save(HERE / "grads.npy", embedding)


if __name__ == "__main__":
    make_npz()
    make_safetensors()
    make_h5()
    make_npy()
    for path in sorted(HERE.glob("grads.*")):
        print(f"{path.name}: {path.stat().st_size} bytes")
