"""``tclip info`` on a DCP folder says which ``.distcp`` files hold each tensor: a ``files``
column (``all 2``, a file's name, ``__0_0…__5_0 (6)``; ``all``/``6 files`` where the terminal is
narrow), a ``stored in`` line with every file's size, and ``chunk_files``/``storage_files`` in
``--json``. The two-rank folder is written by the real ``torch.distributed.checkpoint`` on gloo.
"""

from __future__ import annotations

import io
import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest
from rich.console import Console

from support.cli import run
from support.dcp_helpers import expected, make_all
from tclip.cli.render.info import render_info
from tclip.work.results import InfoReport, InfoTensor
from tclip.work.sets import as_set, set_info

WQ = "model.layers.0.attention.wq.weight"      # Shard(0) on two ranks
W1 = "model.layers.0.feed_forward.w1.weight"   # Shard(0), uneven
WO = "model.layers.0.attention.wo.weight"      # Shard(1)
REPLICATED = ("model.norm.weight", "model.scale")  # Replicate() and a plain tensor: stored once


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    pytest.importorskip("torch")
    path = tmp_path_factory.mktemp("dcp_info")
    make_all(path, ("ranks2", "megatron"))
    return path


def rendered(info: InfoReport, width: int | None) -> list[str]:
    buffer = io.StringIO()
    render_info(info, Console(file=buffer, width=1000, color_system=None), width=width)
    return buffer.getvalue().splitlines()


def row(lines: list[str], name: str) -> str:
    return next(line for line in lines if line.startswith(name + " "))


def test_json_names_the_files_of_each_tensor(root: Path) -> None:
    folder = expected(root, "ranks2")[0]
    result = run("info", "--json", folder)
    assert result.exit_code == 0, result.output
    info = json.loads(result.stdout)
    files = {t["name"]: t["chunk_files"] for t in info["tensors"]}
    for name in (WQ, W1, WO):
        assert files[name] == ["__0_0.distcp", "__1_0.distcp"], name
    for name in REPLICATED:
        assert len(files[name]) == 1 and files[name][0] in ("__0_0.distcp", "__1_0.distcp"), name
    assert info["storage_files"] == [{"file": f, "bytes": os.path.getsize(folder / f)}
                                     for f in ("__0_0.distcp", "__1_0.distcp")]


def test_a_pipe_shows_the_files_column_whole(root: Path) -> None:
    folder = expected(root, "ranks2")[0]
    result = run("info", folder)  # not a terminal: never cut
    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    assert lines[1].split()[-1] == "files"
    assert row(lines, WQ).endswith("  all 2") and row(lines, WO).endswith("  all 2")
    replicated = row(lines, "model.norm.weight").split()[-1]
    assert replicated in ("__0_0", "__1_0")
    sizes = [os.path.getsize(folder / f) for f in ("__0_0.distcp", "__1_0.distcp")]
    assert any(line.startswith("stored in 2 files") and "__0_0.distcp" in line and "__1_0.distcp" in line
               for line in lines), lines
    assert sum(sizes) > 0


def test_eighty_columns_keep_the_names_and_the_files(root: Path) -> None:
    info = set_info(as_set(expected(root, "ranks2")[0] / ".metadata"))
    lines = rendered(info, 80)
    assert all(len(line) <= 80 for line in lines), lines
    assert row(lines, W1).endswith("all 2")  # the whole name, the files beside it


def test_one_file_needs_no_column(root: Path) -> None:
    info = set_info(as_set(expected(root, "megatron")[0] / ".metadata"))
    lines = rendered(info, None)
    assert lines[1].split()[-1] == "bytes"
    assert any(line.startswith("stored in 1 file ") and "__0_0.distcp" in line for line in lines)
    assert all(t.chunk_files == ["__0_0.distcp"] for t in info.tensors)


def test_a_tensor_in_some_files_is_a_run_with_its_count(root: Path, tmp_path: Path) -> None:
    info = set_info(as_set(expected(root, "ranks2")[0] / ".metadata"))
    info.storage_files = {f"__{r}_0.distcp": 10 for r in range(8)}
    for t in info.tensors:
        t.chunk_files = [f"__{r}_0.distcp" for r in (0, 2, 5)] if t.name == WQ else t.chunk_files
    assert row(rendered(info, None), WQ).endswith("__0_0…__5_0 (3)")


def test_thousands_of_tensors_stay_within_eighty_columns() -> None:
    """Past the rows styled one by one, the plain table has the files column too, short when narrow."""
    files = [f"__{r}_0.distcp" for r in range(8)]
    tensors = []
    for layer in range(1500):
        for proj, held in (("q", files), ("k", files), ("v", files[:3]), ("o", [files[layer % 8]])):
            tensors.append(InfoTensor(f"model.layers.{layer}.self_attn.{proj}_proj.weight", [4096, 4096],
                                      np.dtype("float32"), 4096 * 4096 * 4, chunk_files=held))
    info = InfoReport("ckpt/.metadata", "dcp", 1000, tensors, {}, storage_files={f: 1 << 30 for f in files})
    narrow = rendered(info, 80)
    assert all(len(line) <= 80 for line in narrow)
    assert narrow[1].split()[-1] == "files"
    cells = [line[line.rindex("  ") + 2:] for line in narrow[3:7]]
    assert cells == ["all", "all", "3 files", "__0_0"]
    whole = rendered(info, None)
    assert row(whole, "model.layers.17.self_attn.k_proj.weight").endswith("  all 8")
    assert row(whole, "model.layers.17.self_attn.v_proj.weight").endswith("  __0_0…__2_0 (3)")
    assert row(whole, "model.layers.17.self_attn.o_proj.weight").endswith("  __1_0")
    assert any(line.startswith("stored in 8 files") and "__7_0.distcp" in line for line in whole)


def test_files_column_from_a_folder_copy(root: Path, tmp_path: Path) -> None:
    """The names are the folder's own (relative), whatever the folder is called."""
    copy = tmp_path / "step-100"
    shutil.copytree(expected(root, "ranks2")[0], copy)
    info = json.loads(run("info", "--json", copy).stdout)
    assert all(not os.path.isabs(f) for t in info["tensors"] for f in t["chunk_files"])
