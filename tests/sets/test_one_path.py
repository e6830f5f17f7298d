"""A file is a tensor set of one: its JSON object is the same whether it is the only input
or sits beside a sharded checkpoint (one code path for a file and a set).

The schema decided: a file's object has ``output`` (its output, or the one a dry run would
write in ``would_write.output``) and no ``files`` key; ``files`` is only for a set of many
files (an index, a GGUF split set, ``--across-files``)."""

from __future__ import annotations

import json

import numpy as np
from click.testing import CliRunner
from support.sets import sharded

from tclip.cli import cli
from support.formats_helpers import safetensors_bytes

LAYERS = {f"model.layers.{i}.self_attn.k_proj.weight": np.random.default_rng(i).standard_normal((32, 48))
          .astype(np.float32) for i in range(3)}


def lines(*args):
    result = CliRunner().invoke(cli, [str(a) for a in args])
    assert result.exit_code == 0, result.stderr
    out = [json.loads(line) for line in result.stdout.splitlines()]
    for item in out:
        item.pop("elapsed_s", None)
    return out


def inputs(tmp_path):
    grads = tmp_path / "grads.safetensors"
    grads.write_bytes(safetensors_bytes(LAYERS, metadata={"format": "pt"}))
    index = sharded(tmp_path / "ckpt")
    return grads, index


def test_a_dry_run_file_object_is_the_same_alone_and_beside_a_set(tmp_path):
    grads, index = inputs(tmp_path)
    alone = lines("norm", "--clip", "1", "--json", "--dry-run", grads)
    beside = lines("norm", "--clip", "1", "--json", "--dry-run", grads, index)
    assert len(alone) == 1 and len(beside) == 2
    assert alone[0]["would_write"]["output"] == str(tmp_path / "grads.clipped.safetensors")
    assert "files" not in alone[0]
    assert beside[0] == alone[0]
    assert "files" in beside[1]  # the checkpoint: a set of many files lists them


def test_a_clipped_file_object_is_the_same_alone_and_beside_a_set(tmp_path):
    grads, index = inputs(tmp_path)
    alone = lines("global", "--clip", "1", "--json", "--out-dir", tmp_path / "a", grads)
    beside = lines("global", "--clip", "1", "--json", "--out-dir", tmp_path / "b", grads, index)
    assert alone[0]["output"] == str(tmp_path / "a" / grads.name)
    assert beside[0]["output"] == str(tmp_path / "b" / grads.name)
    alone[0].pop("output"), beside[0].pop("output")
    assert beside[0] == alone[0] and "files" not in alone[0]


def test_a_reported_file_object_is_the_same_alone_and_beside_a_set(tmp_path):
    grads, index = inputs(tmp_path)
    alone = lines("report", "--json", grads)
    beside = lines("report", "--json", grads, index)
    assert alone[0]["metadata"] == {"format": "pt"} and "files" not in alone[0]
    assert beside[0] == alone[0]


def test_an_info_file_object_is_the_same_alone_and_beside_a_set(tmp_path):
    grads, index = inputs(tmp_path)
    alone = lines("info", "--json", grads)
    beside = lines("info", "--json", grads, index)
    assert "files" not in alone[0] and beside[0] == alone[0]
    assert beside[1]["files"] == sorted(p.name for p in index.parent.glob("model-*.safetensors"))
