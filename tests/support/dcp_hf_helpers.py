"""DCP checkpoints written per rank without one ``.metadata``, by the real
``torch.distributed.checkpoint`` in a child process (tclip's own process never imports torch):

- ``hf_ranks2``: two ranks on gloo over 127.0.0.1 saving through ``HuggingFaceStorageWriter(...,
  save_distributed=True)`` without consolidation: only ``shard-0000R-model-0000F-of-00002.safetensors``
  files (two files per rank by an ``fqn_to_index_mapping``), each piece's place in its tensor in the
  file's ``__metadata__`` ``DCP_SHARDING_INFO``. DTensors ``Shard(0)`` (uneven: 7x4, 257x3 bf16),
  ``Shard(1)`` (3x9), ``Replicate()`` and a plain 0-d tensor. What torch's
  ``HuggingFaceStorageReader`` loads back into full tensors goes to ``<out>/loaded/expected.*``, and
  torch's own ``consolidate_safetensors_files`` writes ``<out>/consolidated/`` from the shards (torch
  2.13's consolidation writes a 0-d tensor as 0.0 whatever was saved);
- ``hf_single``: one process, the same writer: one ``shard-00001-model-00001-of-00001.safetensors``;
- ``rank_meta``: two ranks saving with ``use_collectives=False``: a ``__R.metadata`` per rank and
  no ``.metadata`` (each rank saves the replicated tensor and the 0-d one too); damaged copies
  under ``rank_meta/broken/``.

Expected values go to ``<out>/expected.npz`` and ``<out>/expected.json`` as in :mod:`dcp_helpers`
(the full tensors the ranks held).
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve()
sys.path.insert(0, str(HERE.parent))

KINDS = ("hf_ranks2", "hf_single", "rank_meta")

WQ = "model.layers.0.attention.wq.weight"     # 7x4 float32, Shard(0): rows 0-3 and 4-6
W1 = "model.layers.0.feed_forward.w1.weight"  # 257x3 bfloat16, Shard(0): 129 + 128 rows
WO = "model.layers.0.attention.wo.weight"     # 3x9 float32, Shard(1): 5 + 4 columns
NORM = "model.norm.weight"                    # 5x3 float32, Replicate()
SCALE = "model.scale"                          # a plain 0-d float32 tensor on every rank


def make_all(root: Path) -> None:
    """Write every kind under ``root/<kind>`` in one child process."""
    root.mkdir(parents=True, exist_ok=True)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(OMP_NUM_THREADS="1", PYTHONHASHSEED="0")
    subprocess.run([sys.executable, str(HERE), str(root), *KINDS], check=True, env=env, timeout=600,
                   capture_output=True)


# ----------------------------------------------------------------------------- the child process


def _full(torch):  # type: ignore[no-untyped-def]
    generator = torch.Generator().manual_seed(2026)
    return {
        WQ: torch.randn(7, 4, generator=generator),
        W1: torch.randn(257, 3, generator=generator).to(torch.bfloat16),
        WO: torch.randn(3, 9, generator=generator),
        NORM: torch.randn(5, 3, generator=generator),
        SCALE: torch.tensor(2.5),
    }


def _state(torch, mesh):  # type: ignore[no-untyped-def]
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    placements = {WQ: Shard(0), W1: Shard(0), WO: Shard(1), NORM: Replicate()}
    return {name: distribute_tensor(t, mesh, [placements[name]]) if name in placements else t
            for name, t in _full(torch).items()}


def _rank(rank: int, port: int, folder: str, kind: str) -> None:
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageWriter
    from torch.distributed.device_mesh import init_device_mesh

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        state = _state(torch, init_device_mesh("cpu", (2,)))
        if kind == "hf_ranks2":
            mapping = {WQ: 1, W1: 2, WO: 1, NORM: 2, SCALE: 1}
            writer = HuggingFaceStorageWriter(folder, fqn_to_index_mapping=mapping, save_distributed=True)
            dcp.save(state, storage_writer=writer)
        else:
            dcp.save(state, checkpoint_id=folder, use_collectives=False)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _rank_entry(rank: int, port: int, folder: str, kind: str) -> None:
    _rank(rank, port, folder, kind)


def _two_ranks(kind: str, out: Path) -> None:
    import torch
    import torch.multiprocessing as mp
    from dcp_helpers import _dump

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    folder = out / "ckpt"
    mp.spawn(_rank_entry, args=(port, str(folder), kind), nprocs=2, join=True)
    _dump(torch, _full(torch), out)
    if kind == "hf_ranks2":
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint import HuggingFaceStorageReader
        from torch.distributed.checkpoint._consolidate_hf_safetensors import consolidate_safetensors_files

        loaded = {name: torch.zeros_like(t) for name, t in _full(torch).items()}
        dcp.load(loaded, storage_reader=HuggingFaceStorageReader(str(folder)), no_dist=True)
        (out / "loaded").mkdir()
        _dump(torch, loaded, out / "loaded")

        (out / "consolidated").mkdir()
        consolidate_safetensors_files(input_dir=str(folder), output_dir=str(out / "consolidated"),
                                      fqn_to_index_mapping={name: 1 for name in _full(torch)})


def _rank_meta_broken(out: Path) -> None:
    """Copies of ``rank_meta/ckpt`` under ``rank_meta/broken/<case>`` whose ``__1.metadata`` is
    changed (through pickle, here in the child, on a file this script wrote)."""
    import dataclasses
    import pickle
    import shutil

    import torch
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex

    def variant(name, mutate):  # type: ignore[no-untyped-def]
        folder = out / "broken" / name
        shutil.copytree(out / "ckpt", folder)
        with open(folder / "__1.metadata", "rb") as handle:
            meta = pickle.load(handle)
        mutate(meta)
        with open(folder / "__1.metadata", "wb") as handle:
            pickle.dump(meta, handle)

    def shape(meta):  # type: ignore[no-untyped-def]
        meta.state_dict_metadata[WQ] = dataclasses.replace(meta.state_dict_metadata[WQ], size=torch.Size([8, 4]))

    def overlap(meta):  # type: ignore[no-untyped-def]
        meta.state_dict_metadata[WQ].chunks[0] = ChunkStorageMetadata(offsets=torch.Size([3, 0]),
                                                                      sizes=torch.Size([3, 4]))
        old = next(k for k in meta.storage_data if k.fqn == WQ)
        meta.storage_data[MetadataIndex(WQ, torch.Size([3, 0]), 0)] = meta.storage_data.pop(old)

    variant("shape", shape)
    variant("overlap", overlap)
    missing = out / "broken" / "missing_rank"
    shutil.copytree(out / "ckpt", missing)
    (missing / "__0.metadata").unlink()


def _hf_single(out: Path) -> None:
    import torch
    import torch.distributed.checkpoint as dcp
    from dcp_helpers import _dump
    from torch.distributed.checkpoint import HuggingFaceStorageWriter

    state = _full(torch)
    dcp.save(state, storage_writer=HuggingFaceStorageWriter(str(out / "ckpt"), save_distributed=True), no_dist=True)
    _dump(torch, state, out)


if __name__ == "__main__":
    target = Path(sys.argv[1])
    for which in sys.argv[2:]:
        (target / which).mkdir(parents=True, exist_ok=True)
        if which == "hf_single":
            _hf_single(target / which)
        else:
            _two_ranks(which, target / which)
        if which == "rank_meta":
            _rank_meta_broken(target / which)
