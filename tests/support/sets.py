"""Tensor sets as transformers writes them: safetensors shards beside a ``model.safetensors.index.json``."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from support.formats_helpers import read_all, safetensors_bytes


RNG = np.random.default_rng(33)
TENSORS = {f"model.layers.{i}.mlp.{p}.weight": (RNG.standard_normal((48, 40)) * (i + 1)).astype(np.float32)
           for i in range(6) for p in ("up", "down")}
TENSORS["model.embed_tokens.weight"] = RNG.standard_normal((100, 40)).astype(np.float32)
TENSORS["lm_head.weight"] = RNG.standard_normal((100, 40)).astype(np.float32)


def sharded(folder: Path, tensors=TENSORS, shards: int = 3, total_size: int = 12345) -> Path:
    """A checkpoint laid out as transformers' save_pretrained writes one: shards and an index."""
    folder.mkdir(parents=True, exist_ok=True)
    names = list(tensors)
    weight_map = {}
    for s in range(shards):
        part = names[s::shards]
        shard = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        (folder / shard).write_bytes(safetensors_bytes({n: tensors[n] for n in part}, metadata={"format": "pt"}))
        weight_map.update({n: shard for n in part})
    index = folder / "model.safetensors.index.json"
    index.write_text(json.dumps({"metadata": {"total_size": total_size}, "weight_map": dict(sorted(weight_map.items()))},
                                indent=2))
    return index


def single(folder: Path, tensors=TENSORS) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "all.safetensors"
    path.write_bytes(safetensors_bytes(tensors))
    return path


def all_tensors(folder: Path) -> dict[str, np.ndarray]:
    out = {}
    for shard in sorted(folder.glob("model-*.safetensors")):
        out.update(read_all(shard))
    return out


def interrupted(tmp_path: Path, monkeypatch) -> tuple[Path, Path]:  # type: ignore[no-untyped-def]
    """A sharded checkpoint whose in-place global clip died (KeyboardInterrupt) after its first
    shard: (its index, its journal)."""
    import pytest

    from tclip.core.modes import GlobalNormClip
    from tclip.formats.sharded import TensorSet
    from tclip.work import clip as clipping  # where clipping a set runs its tasks
    from tclip.work.options import ClipOptions

    index = sharded(tmp_path / "ckpt")
    real = clipping.rewrite_task
    calls = []

    def crash_on_second(*args, **kwargs):  # type: ignore[no-untyped-def]
        calls.append(args[0])
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    monkeypatch.setattr(clipping, "rewrite_task", crash_on_second)
    with pytest.raises(KeyboardInterrupt):
        clipping.clip_set(TensorSet(str(index), [], index), GlobalNormClip(1.0), ClipOptions(in_place=True, threads=1))
    monkeypatch.undo()
    return index, index.with_name(index.name + ".tclip-journal")
