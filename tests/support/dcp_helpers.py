"""PyTorch Distributed Checkpoint (DCP) folders written by the real ``torch.distributed.checkpoint``,
for tests: this module runs as a script in a child process with torch (tclip's own process never
imports torch), and the tests call :func:`make` to get a folder and what torch loads back from it.

Kinds:

- ``single``: one process, a torchtitan-style state (bf16 weights, an f32 norm, AdamW state after
  three steps flattened as ``optimizer.state.<fqn>.exp_avg``, ``train_state``, an lr scheduler);
- ``ranks2``: two ranks on gloo over 127.0.0.1, DTensors ``Shard(0)`` (uneven: 7x4 and 257x3 on two
  ranks), ``Shard(1)`` (3x9) and ``Replicate()``;
- ``safetensors``: one process, ``SerializationFormat.SAFETENSORS`` (torch cannot load it back: the
  expected values are the tensors saved);
- ``zstd``: one process, every item through the ``ZStandard`` extension;
- ``megatron``: a Megatron-Core ``torch_dist`` folder (Megatron's names, its ``.metadata``
  pickled as ``MCoreMetadata`` as mcore 0.15 wrote it, ``metadata.json`` and ``common.pt``,
  which pickles ``args`` as an ``argparse.Namespace`` as Megatron's does), and beside it
  ``common_plain.pt``: a ``common.pt`` of plain values and an rng state only.

Expected values go to ``<out>/expected.npz`` (each tensor's bytes as uint8, keyed by its flat name)
and ``<out>/expected.json`` (dtype and shape per name, the non-tensor values where they are plain).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve()


KINDS = ("single", "ranks2", "safetensors", "zstd", "broken", "megatron")


def make_all(root: Path, kinds: tuple[str, ...] = KINDS) -> None:
    """Write every kind (or ``kinds``) under ``root/<kind>`` in one child process (torch is
    imported once; ``broken`` needs ``ranks2``)."""
    root.mkdir(parents=True, exist_ok=True)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(OMP_NUM_THREADS="1", PYTHONHASHSEED="0")
    subprocess.run([sys.executable, str(HERE), str(root), *kinds], check=True, env=env, timeout=600,
                   capture_output=True)


def expected(root: Path, kind: str) -> tuple[Path, dict, dict]:
    """(folder, expected arrays by name as uint8, expected json) of a kind written by :func:`make_all`."""
    import numpy as np

    with np.load(root / kind / "expected.npz") as data:
        arrays = {name: data[name] for name in data.files}
    return root / kind / "ckpt", arrays, json.loads((root / kind / "expected.json").read_text())


# ----------------------------------------------------------------------------- the child process


def _model_state(torch, nn):  # type: ignore[no-untyped-def]
    torch.manual_seed(1234)

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.attention = nn.Module()
            self.attention.wq = nn.Linear(16, 16, bias=False)
            self.attention.wk = nn.Linear(16, 8, bias=False)
            self.feed_forward = nn.Module()
            self.feed_forward.w1 = nn.Linear(16, 24, bias=False)
            self.attention_norm = nn.RMSNorm(16)

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.tok_embeddings = nn.Embedding(32, 16)
            self.layers = nn.ModuleDict({"0": Block(), "1": Block()})
            self.norm = nn.RMSNorm(16)
            self.output = nn.Linear(16, 32, bias=False)

    model = Model()
    for name, param in model.named_parameters():
        if "norm" not in name:
            param.data = param.data.to(torch.bfloat16)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    for _ in range(3):
        tokens = torch.randint(0, 32, (4, 8))
        hidden = model.tok_embeddings(tokens)
        for block in model.layers.values():
            x = block.attention_norm(hidden.float()).to(torch.bfloat16)
            hidden = hidden + block.attention.wq(x) + block.feed_forward.w1(x)[..., :16]
        loss = model.output(model.norm(hidden.float()).to(torch.bfloat16)).float().pow(2).mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        scheduler.step()
    return model, optimizer, scheduler


def _single_state(torch, nn):  # type: ignore[no-untyped-def]
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    model, optimizer, scheduler = _model_state(torch, nn)
    options = StateDictOptions(flatten_optimizer_state_dict=True)
    return {
        **get_model_state_dict(model),
        "optimizer": get_optimizer_state_dict(model, optimizer, options=options),
        "lr_scheduler": scheduler.state_dict(),
        "train_state": {"step": torch.tensor(3, dtype=torch.int32), "global_avg_losses": [0.5, 0.25, 0.125]},
    }


def _flat(state, prefix=""):  # type: ignore[no-untyped-def]
    for key, value in state.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            yield from _flat(value, f"{name}.")
        else:
            yield name, value


def _dump(torch, state, out: Path) -> None:  # type: ignore[no-untyped-def]
    import numpy as np

    arrays, meta = {}, {"tensors": {}, "others": {}}
    for name, value in _flat(state):
        if isinstance(value, torch.Tensor):
            value = value.full_tensor() if hasattr(value, "full_tensor") else value
            tensor = value.detach().contiguous().reshape(-1)
            arrays[name] = tensor.view(torch.uint8).numpy().copy() if tensor.numel() else np.zeros(0, np.uint8)
            meta["tensors"][name] = {"dtype": str(value.dtype).removeprefix("torch."), "shape": list(value.shape)}
        elif isinstance(value, bool | int | float | str) or value is None:
            meta["others"][name] = value
        else:
            meta["others"][name] = repr(value)
    np.savez(out / "expected.npz", **arrays)
    (out / "expected.json").write_text(json.dumps(meta, indent=1))


def _load_back(torch, folder: Path):  # type: ignore[no-untyped-def]
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict_from_keys

    return _load_state_dict_from_keys(checkpoint_id=str(folder))


def _single(kind: str, out: Path) -> None:
    import torch
    import torch.distributed.checkpoint as dcp
    from torch import nn
    from torch.distributed.checkpoint import FileSystemWriter

    state = _single_state(torch, nn)
    folder = out / "ckpt"
    if kind == "single":
        # a transposed view whose storage is exactly its size: torch.save keeps it a view (not cloned),
        # so its chunk is a strided tensor (safetensors, hence the SAFETENSORS variant, refuses those)
        state["lm_head.transposed"] = torch.randn(4, 6, generator=torch.Generator().manual_seed(5)).t()
        dcp.save(state, checkpoint_id=str(folder), no_dist=True)
        _dump(torch, _load_back(torch, folder), out)
    elif kind == "zstd":
        from torch.distributed.checkpoint._extension import ZStandard

        dcp.save(state, storage_writer=FileSystemWriter(str(folder), _extensions=[ZStandard()]), no_dist=True)
        _dump(torch, _load_back(torch, folder), out)
    elif kind == "safetensors":
        from torch.distributed.checkpoint.filesystem import SerializationFormat

        writer = FileSystemWriter(str(folder), serialization_format=SerializationFormat.SAFETENSORS)
        dcp.save(state, storage_writer=writer, no_dist=True)
        _dump(torch, state, out)  # torch 2.13 cannot load this variant back
    else:
        raise SystemExit(f"unknown kind {kind}")


def _rank(rank: int, port: int, folder: str) -> None:
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        mesh = init_device_mesh("cpu", (2,))
        generator = torch.Generator().manual_seed(99)
        full = {
            "model.layers.0.attention.wq.weight": torch.randn(7, 4, generator=generator),
            "model.layers.0.feed_forward.w1.weight": torch.randn(257, 3, generator=generator).to(torch.bfloat16),
            "model.layers.0.attention.wo.weight": torch.randn(3, 9, generator=generator),
            "model.norm.weight": torch.randn(5, 3, generator=generator),
            "model.scale": torch.tensor(2.5),
        }
        placements = {"model.layers.0.attention.wq.weight": Shard(0), "model.layers.0.feed_forward.w1.weight": Shard(0),
                      "model.layers.0.attention.wo.weight": Shard(1), "model.norm.weight": Replicate()}
        state = {name: distribute_tensor(t, mesh, [placements[name]]) if name in placements else t
                 for name, t in full.items()}
        state["step"] = 11
        dcp.save(state, checkpoint_id=folder)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _ranks2(out: Path) -> None:
    import torch
    import torch.multiprocessing as mp

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    folder = out / "ckpt"
    mp.spawn(_rank_entry, args=(port, str(folder)), nprocs=2, join=True)
    _dump(torch, _load_back(torch, folder), out)


def _rank_entry(rank: int, port: int, folder: str) -> None:
    _rank(rank, port, folder)


class _Payload:
    """Unpickling this runs a shell command that creates ``marker``: planted to prove nothing is run."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):  # type: ignore[no-untyped-def]
        return (os.system, (f"touch {self.marker}",))


def _broken(root: Path) -> None:
    """Damaged and hostile copies of ``root/ranks2/ckpt``, each in ``root/broken/<name>`` (the
    mutations go through pickle here, in the child, on files this script wrote itself)."""
    import dataclasses
    import io
    import pickle
    import shutil

    import torch
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex

    source = root / "ranks2" / "ckpt"
    wq = "model.layers.0.attention.wq.weight"

    def variant(name, mutate):  # type: ignore[no-untyped-def]
        folder = root / "broken" / name
        shutil.copytree(source, folder)
        with open(folder / ".metadata", "rb") as handle:
            meta = pickle.load(handle)
        mutate(meta, folder)
        with open(folder / ".metadata", "wb") as handle:
            pickle.dump(meta, handle)

    def key_of(meta, fqn, index=None):  # type: ignore[no-untyped-def]
        return next(k for k in meta.storage_data if k.fqn == fqn and k.index == index)

    def set_item(meta, key, **changes):  # type: ignore[no-untyped-def]
        meta.storage_data[key] = dataclasses.replace(meta.storage_data[key], **changes)

    def move_chunk(meta, offsets, sizes):  # type: ignore[no-untyped-def]
        entry = meta.state_dict_metadata[wq]
        entry.chunks[1] = ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=torch.Size(sizes))
        old = key_of(meta, wq, 1)
        meta.storage_data[MetadataIndex(wq, torch.Size(offsets), 1)] = meta.storage_data.pop(old)

    def append(folder, key_meta, blob):  # type: ignore[no-untyped-def]
        meta, key = key_meta
        path = folder / meta.storage_data[key].relative_path
        offset = path.stat().st_size
        with open(path, "ab") as handle:
            handle.write(blob)
        set_item(meta, key, offset=offset, length=len(blob))

    def hostile_zip(folder):  # type: ignore[no-untyped-def]
        buffer = io.BytesIO()
        torch.save(_Payload(str(folder / "PWNED")), buffer)
        return buffer.getvalue()

    variant("overlap", lambda m, f: move_chunk(m, (3, 0), (3, 4)))
    variant("gap", lambda m, f: move_chunk(m, (4, 0), (2, 4)))
    variant("missing_file", lambda m, f: set_item(m, key_of(m, wq, 1), relative_path="__9_0.distcp"))
    variant("escape", lambda m, f: set_item(m, key_of(m, wq, 1), relative_path="../outside.distcp"))
    variant("absolute", lambda m, f: set_item(m, key_of(m, wq, 1),
                                              relative_path=str((f / "__1_0.distcp").resolve())))
    variant("past_end", lambda m, f: set_item(m, key_of(m, "model.scale", 0),
                                              length=m.storage_data[key_of(m, "model.scale", 0)].length + 100))

    def bytes_overlap(meta, folder):  # type: ignore[no-untyped-def]
        chunk = meta.storage_data[key_of(meta, wq, 1)]
        set_item(meta, key_of(meta, "step"), offset=chunk.offset, length=chunk.length)

    variant("bytes_overlap", bytes_overlap)
    variant("hostile_chunk", lambda m, f: append(f, (m, key_of(m, "model.scale", 0)), hostile_zip(f)))
    variant("hostile_bytes_item", lambda m, f: append(f, (m, key_of(m, "step")), hostile_zip(f)))

    def hostile_metadata(meta, folder):  # type: ignore[no-untyped-def]
        meta.storage_meta = _Payload(str(folder / "PWNED"))

    variant("hostile_metadata", hostile_metadata)
    shutil.copy(source / "__1_0.distcp", root / "broken" / "outside.distcp")
    truncated = root / "broken" / "truncated"
    shutil.copytree(source, truncated)
    with open(truncated / "__1_0.distcp", "r+b") as handle:
        handle.truncate(3000)


def _mcore_metadata_class():  # type: ignore[no-untyped-def]
    """Megatron-Core 0.15's ``MCoreMetadata`` (a ``Metadata`` dataclass with ``mcore_data``),
    registered under its real module name so that pickle names it as Megatron's files do
    (Megatron itself is not installable here)."""
    import dataclasses
    import types

    from torch.distributed.checkpoint.metadata import Metadata

    module_name = "megatron.core.dist_checkpointing.strategies.torch"
    parts = module_name.split(".")
    for i in range(1, len(parts) + 1):
        sys.modules.setdefault(".".join(parts[:i]), types.ModuleType(".".join(parts[:i])))

    @dataclasses.dataclass
    class MCoreMetadata(Metadata):
        mcore_data: dict | None = None

    MCoreMetadata.__module__ = module_name
    MCoreMetadata.__qualname__ = "MCoreMetadata"
    sys.modules[module_name].MCoreMetadata = MCoreMetadata  # type: ignore[attr-defined]
    return MCoreMetadata


def _megatron(out: Path) -> None:
    """A Megatron-Core torch_dist folder: what ``dist_checkpointing.save`` leaves on disk."""
    import argparse
    import io
    import pickle

    import torch
    import torch.distributed.checkpoint as dcp

    generator = torch.Generator().manual_seed(7)
    qkv = "decoder.layers.self_attention.linear_qkv.weight"  # Megatron stacks the layers: (layers, out, in)
    state = {
        "embedding.word_embeddings.weight": torch.randn(32, 16, generator=generator).to(torch.bfloat16),
        qkv: torch.randn(2, 48, 16, generator=generator).to(torch.bfloat16),
        "decoder.final_layernorm.weight": torch.ones(16),
        "output_layer.weight": torch.randn(32, 16, generator=generator).to(torch.bfloat16),
        f"optimizer.state.fp32_param.{qkv}": torch.randn(2, 48, 16, generator=generator),
        f"optimizer.state.exp_avg.{qkv}": torch.randn(2, 48, 16, generator=generator) * 1e-3,
        f"optimizer.state.exp_avg_sq.{qkv}": torch.rand(2, 48, 16, generator=generator) * 1e-6,
        # ShardedObjects: BytesIO written raw, named <key>/shard_<offsets>_<global shape>
        "rng_state/shard_0.0_1.1": io.BytesIO(pickle.dumps({"random_rng_state": (3, (1, 2), None)})),
    }
    folder = out / "ckpt"
    dcp.save(state, checkpoint_id=str(folder), no_dist=True)
    with open(folder / ".metadata", "rb") as handle:
        meta = pickle.load(handle)
    mcore = _mcore_metadata_class()(mcore_data={qkv: {"nd_reformulated_orig_global_shape": (2, 48, 16)}},
                                    **vars(meta))
    with open(folder / ".metadata", "wb") as handle:
        pickle.dump(mcore, handle)
    (folder / "metadata.json").write_text(json.dumps({"sharded_backend": "torch_dist", "sharded_backend_version": 1,
                                                      "common_backend": "torch", "common_backend_version": 1}))
    args = argparse.Namespace(num_layers=2, hidden_size=16, params_dtype=torch.bfloat16, lr=3e-4)
    common = {"iteration": 1000, "checkpoint_version": 3.0, "num_floating_point_operations_so_far": 1.5e15,
              "opt_param_scheduler": {"max_lr": 3e-4, "num_steps": 1000}}
    torch.save({"args": args, **common}, folder / "common.pt")
    torch.save({**common, "rng_tracker_states": torch.arange(16, dtype=torch.uint8)}, out / "common_plain.pt")
    _dump(torch, {k: v for k, v in state.items() if isinstance(v, torch.Tensor)}, out)


if __name__ == "__main__":
    target = Path(sys.argv[1])
    for which in sys.argv[2:]:
        (target / which).mkdir(parents=True, exist_ok=True)
        if which == "ranks2":
            _ranks2(target / which)
        elif which == "broken":
            _broken(target)
        elif which == "megatron":
            _megatron(target / which)
        else:
            _single(which, target / which)
