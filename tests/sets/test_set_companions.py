"""``--out-dir`` for an index copies the checkpoint folder's other files (issue 20.16)."""

from __future__ import annotations

import json
import os

import pytest
from click.testing import CliRunner

from support.cli import run
from support.sets import sharded
from tclip.cli import cli

OTHERS = {
    "config.json": '{"model_type": "llama", "num_hidden_layers": 6}\n',
    "generation_config.json": '{"do_sample": false}\n',
    "tokenizer.json": '{"version": "1.0"}\n',
    "tokenizer_config.json": "{}\n",
    "special_tokens_map.json": "{}\n",
    "README.md": "# a model card\n",
    ".gitattributes": "*.safetensors filter=lfs\n",
    "tokenizer.model": "\x00sentencepiece",
}


def checkpoint(folder):
    index = sharded(folder)
    for name, text in OTHERS.items():
        (folder / name).write_text(text)
    (folder / "pytorch_model.bin.index.json").write_text(json.dumps({"weight_map": {}}))
    (folder / "runs").mkdir()
    (folder / "runs" / "events.out").write_text("log")
    return index


def test_out_dir_copies_the_folders_other_files_and_says_so(tmp_path):
    index = checkpoint(tmp_path / "ckpt")
    os.chmod(tmp_path / "ckpt" / "tokenizer.model", 0o600)
    result = CliRunner(env={"COLUMNS": "80"}).invoke(cli, ["global", "--clip", "1", "--out-dir",
                                                           str(tmp_path / "out"), str(index)])
    assert result.exit_code == 0, result.stderr
    out = tmp_path / "out"
    for name, text in OTHERS.items():
        assert (out / name).read_text() == text, name
    assert (out / "tokenizer.model").stat().st_mode & 0o777 == 0o600
    assert not (out / "pytorch_model.bin.index.json").exists() and not (out / "runs").exists()
    assert sorted(p.name for p in out.iterdir()) == sorted(
        [*OTHERS, index.name, *(p.name for p in index.parent.glob("model-*.safetensors"))])
    assert "copied 8 other file(s) of the checkpoint's folder: .gitattributes, README.md, config.json, " \
           "generation_config.json and 4 more" in result.stdout
    assert "not copied: pytorch_model.bin.index.json (weights tclip did not clip); runs/ (a folder)" in result.stdout
    data = json.loads(run("global", "--clip", "1", "--json", "--force", "--out-dir", out, index).stdout)
    assert data["copied"] == [".gitattributes", "README.md", "config.json", "generation_config.json",
                              "special_tokens_map.json", "tokenizer.json", "tokenizer.model", "tokenizer_config.json"]
    assert data["not_copied"] == [{"name": "pytorch_model.bin.index.json", "reason": "weights tclip did not clip"},
                                  {"name": "runs/", "reason": "a folder"}]


def test_an_existing_copy_target_needs_force_and_a_dry_run_says_so(tmp_path):
    index = checkpoint(tmp_path / "ckpt")
    out = tmp_path / "out"
    out.mkdir()
    (out / "config.json").write_text("mine")
    dry = run("global", "--clip", "1", "--dry-run", "--json", "--out-dir", out, index)
    copies = {os.path.basename(c["output"]): c["exists"] for c in json.loads(dry.stdout)["would_write"]["copies"]}
    assert copies == {name: name == "config.json" for name in OTHERS}
    refused = run("global", "--clip", "1", "--out-dir", out, index)
    assert refused.exit_code == 1 and "config.json: output already exists" in refused.stderr
    assert sorted(p.name for p in out.iterdir()) == ["config.json"] and (out / "config.json").read_text() == "mine"


@pytest.mark.slow  # transformers loads a model
def test_transformers_loads_the_copied_config(tmp_path):
    transformers = pytest.importorskip("transformers")
    index = checkpoint(tmp_path / "ckpt")
    assert run("global", "--clip", "1", "--out-dir", tmp_path / "out", index).exit_code == 0
    config = transformers.AutoConfig.from_pretrained(str(tmp_path / "out"))
    assert config.model_type == "llama" and config.num_hidden_layers == 6
