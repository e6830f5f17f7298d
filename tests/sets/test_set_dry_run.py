"""Dry runs of sets say exactly what a real run would write and what exists (issue 20.7)."""

from __future__ import annotations

import json
import shutil

import numpy as np
from click.testing import CliRunner

from support.cli import run
from support.sets import sharded
from tclip.cli import cli


def text_run(*args):
    return CliRunner(env={"COLUMNS": "80"}).invoke(cli, [str(a) for a in args])


def test_a_sharded_dry_run_into_an_existing_out_dir_names_every_output_and_which_exist(tmp_path):
    index = sharded(tmp_path / "ckpt")
    out = tmp_path / "out"
    out.mkdir()
    shards = sorted(p.name for p in index.parent.glob("*.safetensors"))
    shutil.copyfile(index.parent / shards[1], out / shards[1])
    before = sorted(p.name for p in out.iterdir())
    result = run("global", "--clip", "1", "--dry-run", "--json", "--out-dir", out, index)
    assert result.exit_code == 0, result.stderr
    would = json.loads(result.stdout)["would_write"]
    assert would["output"] == str(out / index.name) and would["exists"] is False and would["in_place"] is False
    assert sorted(f["output"] for f in would["files"]) == [str(out / s) for s in shards]
    assert {f["file"]: f["exists"] for f in would["files"]} == {str(index.parent / s): s == shards[1] for s in shards}
    text = text_run("global", "--clip", "1", "--dry-run", "--out-dir", out, index)
    title = text.stdout.splitlines()[0]
    assert f"would write {out / index.name} and its 3 shard(s) (1 of 4 exist: a real run needs --force)" in title
    assert f"exist already: {out / shards[1]}" in text.stdout.splitlines()
    forced = text_run("global", "--clip", "1", "--dry-run", "--force", "--out-dir", out, index)
    assert "(1 of 4 exist: --force replaces them)" in forced.stdout.splitlines()[0]
    assert sorted(p.name for p in out.iterdir()) == before
    real = run("global", "--clip", "1", "--out-dir", out, index)
    assert real.exit_code == 1 and "output already exists" in real.stderr  # as the dry run said


def test_an_in_place_dry_run_never_asks_for_force(tmp_path):
    index = sharded(tmp_path / "ckpt")
    result = text_run("global", "--clip", "1", "--in-place", "--dry-run", index)
    assert result.exit_code == 0, result.stderr
    assert "would replace 3 file(s) and the index in place; nothing written" in result.stdout.splitlines()[0]
    assert "--force" not in result.stdout
    data = json.loads(run("global", "--clip", "1", "--in-place", "--dry-run", "--json", index).stdout)
    assert data["would_write"]["in_place"] is True and data["would_write"]["output"] == str(index)
    assert all(f["exists"] and f["output"] == f["file"] for f in data["would_write"]["files"])
    one = tmp_path / "grads.npz"
    np.savez(one, **{"model.layers.17.self_attn.k_proj.weight": np.full((64, 64), 3, np.float32)})
    single = text_run("norm", "--clip", "1", "--in-place", "--dry-run", one)
    assert single.exit_code == 0, single.stderr
    assert f"(dry run: would replace {one} in place; nothing written)" in single.stdout
    assert "--force" not in single.stdout


def test_a_dry_run_of_an_index_without_an_output_folder_says_the_run_would_fail(tmp_path):
    index = sharded(tmp_path / "ckpt")
    result = text_run("global", "--clip", "1", "--dry-run", index)
    assert result.exit_code == 0, result.stderr
    assert result.stderr == (f"Warning: {index}: a real run would fail: a sharded checkpoint needs --out-dir DIR "
                             "(shards and index keep their names) or --in-place\n")
    assert "(dry run: would write nothing; nothing written)" in result.stdout


def test_across_files_dry_run_names_each_output(tmp_path):
    for name in ("stage0.npz", "stage1.npz"):
        np.savez(tmp_path / name, **{f"{name[:6]}.layers.0.mlp.up_proj.weight": np.full((8, 8), 2, np.float32)})
    (tmp_path / "stage1.clipped.npz").write_bytes(b"old")
    result = run("global", "--clip", "1", "--across-files", "--dry-run", "--json",
                 tmp_path / "stage0.npz", tmp_path / "stage1.npz")
    assert result.exit_code == 0, result.stderr
    would = json.loads(result.stdout)["would_write"]
    assert would["output"] is None
    assert [(f["output"], f["exists"]) for f in would["files"]] == [
        (str(tmp_path / "stage0.clipped.npz"), False), (str(tmp_path / "stage1.clipped.npz"), True)]
