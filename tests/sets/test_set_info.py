"""``info`` on a set says which shard holds each tensor, and sets list their files in
natural order (issue 20.17)."""

from __future__ import annotations

import io
import json
from pathlib import Path

import numpy as np
from rich.console import Console

from support.cli import run
from support.sets import sharded
from tclip.cli.render.info import render_info
from tclip.work.sets import index_info

LLAMA = {f"model.layers.{i}.self_attn.{p}_proj.weight": np.full((64, 64), i + 1, np.float32)
         for i in range(12) for p in "qkvo"}
SHARDS = [f"model-{i:05d}-of-00011.safetensors" for i in range(1, 12)]


def weight_map(index: Path) -> dict[str, str]:
    return json.loads(index.read_text())["weight_map"]


def test_info_json_names_each_tensors_shard_and_the_shards_in_natural_order(tmp_path):
    index = sharded(tmp_path / "ckpt", LLAMA, shards=11)
    assert list(dict.fromkeys(weight_map(index).values())) != SHARDS  # the weight map scrambles them
    result = run("info", "--json", index)
    assert result.exit_code == 0, result.stderr
    data = json.loads(result.stdout)
    assert data["files"] == SHARDS
    assert {t["name"]: t["file"] for t in data["tensors"]} == weight_map(index)


def test_info_shows_a_shard_column_that_fits_80_columns(tmp_path):
    index = sharded(tmp_path / "ckpt", LLAMA, shards=11)
    console = Console(file=io.StringIO(), width=80, color_system=None)
    render_info(index_info(index), console, sort="name")
    lines = console.file.getvalue().splitlines()
    assert lines[1].split() == ["tensor", "shape", "dtype", "params", "bytes", "shard"]
    row = next(line for line in lines if line.startswith("model.layers.0.self_attn.k_proj.weight"))
    shard = weight_map(index)["model.layers.0.self_attn.k_proj.weight"]
    assert row.endswith(f"{SHARDS.index(shard) + 1}/11") and all(len(line) <= 80 for line in lines[1:])  # [0]: the path
    piped = run("info", index)  # a pipe: never cut, the file names themselves
    row = next(line for line in piped.stdout.splitlines() if line.startswith("model.layers.0.self_attn.k_proj."))
    assert row.endswith(shard)


def test_report_and_clip_json_list_a_sets_files_in_natural_order(tmp_path):
    index = sharded(tmp_path / "ckpt", LLAMA, shards=11)
    report = json.loads(run("report", "--json", index).stdout)
    assert [Path(f["file"]).name for f in report["files"]] == SHARDS
    clip = run("global", "--clip", "1", "--json", "--out-dir", tmp_path / "out", index)
    assert clip.exit_code == 0, clip.stderr
    assert [Path(f["output"]).name for f in json.loads(clip.stdout)["files"]] == SHARDS
