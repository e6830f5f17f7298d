"""The folders users have: a Hugging Face Trainer's ``checkpoint-100/``, a ``save_pretrained``
folder, globs of such folders and of their indexes, and ``diff`` of two of them."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from importlib.util import find_spec
from pathlib import Path

import numpy as np
import pytest

from support.cli import run
from support.formats_helpers import read_all, safetensors_bytes
from support.sets import sharded

pytestmark = pytest.mark.slow  # Trainer and save_pretrained folders written by torch and transformers


RNG = np.random.default_rng(2024)
LAYERS = {f"model.layers.{i}.self_attn.{p}_proj.weight": RNG.standard_normal((24, 16)).astype(np.float32)
          for i in range(3) for p in ("q", "k")}
LAYERS["lm_head.weight"] = RNG.standard_normal((40, 16)).astype(np.float32)
SIDE_FILES = {
    "config.json": '{"model_type": "llama", "num_hidden_layers": 3}\n',
    "generation_config.json": '{"do_sample": false}\n',
    "hf_quant_config.json": '{"quantization": {"quant_algo": null}}\n',
    "tokenizer.json": '{"version": "1.0"}\n',
    "tokenizer_config.json": "{}\n",
    "special_tokens_map.json": "{}\n",
}

# What transformers' Trainer._save_checkpoint writes beside the model, with torch itself:
# torch.save(optimizer.state_dict()), torch.save(scheduler.state_dict()), the generators'
# states (Python's tuple, NumPy's arrays through pickle globals, torch's byte tensor) and the
# TrainingArguments object (a stand-in class under transformers' module name, so the test
# needs no transformers). Run in a subprocess: tclip never imports torch.
TRAINER = textwrap.dedent("""
    import dataclasses, json, random, sys, types
    from pathlib import Path
    import numpy as np, torch

    out = Path(sys.argv[1])
    torch.manual_seed(int(sys.argv[2]))
    np.random.seed(0)
    random.seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 24), torch.nn.Linear(24, 8))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    for _ in range(2):
        model(torch.randn(4, 16)).square().sum().backward()
        optimizer.step()
        scheduler.step()
    torch.save(optimizer.state_dict(), out / "optimizer.pt")
    torch.save(scheduler.state_dict(), out / "scheduler.pt")
    torch.save({"python": random.getstate(), "numpy": np.random.get_state(),
                "cpu": torch.random.get_rng_state()}, out / "rng_state.pth")

    module = types.ModuleType("transformers.training_args")

    @dataclasses.dataclass
    class TrainingArguments:
        output_dir: str = "trainer"
        learning_rate: float = 5e-5
        per_device_train_batch_size: int = 8

    TrainingArguments.__module__ = module.__name__
    module.TrainingArguments = TrainingArguments
    sys.modules.setdefault("transformers", types.ModuleType("transformers"))
    sys.modules[module.__name__] = module
    torch.save(TrainingArguments(), out / "training_args.bin")
    (out / "trainer_state.json").write_text(json.dumps({"global_step": 100, "log_history": []}))
""")


def torch_script(script: str, *args) -> None:
    """Run ``script`` with torch in a subprocess (offline: a local folder is all it may load)."""
    if find_spec("torch") is None:
        pytest.skip("torch writes these files (the test-torch extra)")
    done = subprocess.run([sys.executable, "-c", script, *map(str, args)], capture_output=True, text=True,
                          env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert done.returncode == 0, done.stderr


def pretrained(folder: Path, scale: float = 1.0) -> Path:
    """A save_pretrained folder: one model.safetensors and the files from_pretrained reads."""
    folder.mkdir(parents=True)
    (folder / "model.safetensors").write_bytes(safetensors_bytes({n: t * np.float32(scale) for n, t in LAYERS.items()},
                                                                 metadata={"format": "pt"}))
    for name, text in SIDE_FILES.items():
        (folder / name).write_text(text)
    return folder


def trainer_checkpoint(folder: Path, seed: int = 0, scale: float = 1.0) -> Path:
    pretrained(folder, scale)
    torch_script(TRAINER, folder, seed)
    return folder


@pytest.fixture(scope="module")
def two_checkpoints(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("trainer")
    trainer_checkpoint(root / "checkpoint-100", seed=0)
    trainer_checkpoint(root / "checkpoint-200", seed=1, scale=3.0)
    return root


# ------------------------------------------------------------------ a Trainer's checkpoint


def test_a_trainer_checkpoint_is_read_and_its_files_without_tensors_are_warnings(two_checkpoints):
    folder = two_checkpoints / "checkpoint-100"
    result = run("report", "--json", folder)
    assert result.exit_code == 0, result.stderr
    files = [json.loads(line)["file"] for line in result.stdout.splitlines()]
    assert files == [str(folder / n) for n in ("model.safetensors", "optimizer.pt", "scheduler.pt")]
    for name in ("rng_state.pth", "training_args.bin"):
        assert f"Warning: {folder / name}: " in result.stderr and "holds no tensors tclip reads" in result.stderr
    assert "Error" not in result.stderr and "save the state_dict" not in result.stderr


def test_such_a_file_named_alone_is_an_error_without_state_dict_advice(two_checkpoints):
    for name in ("rng_state.pth", "training_args.bin"):
        result = run("report", two_checkpoints / "checkpoint-100" / name)
        assert result.exit_code == 1
        assert "holds no tensors tclip reads" in result.stderr and "save the state_dict" not in result.stderr


def test_a_model_saved_whole_in_a_folder_is_still_refused(tmp_path):
    # Its pickle names float storages: tensors tclip cannot read are never passed over as "no tensors".
    folder = pretrained(tmp_path / "ckpt")
    torch_script("import sys, torch; torch.save(torch.nn.Linear(4, 3), sys.argv[1])", folder / "whole.pt")
    result = run("report", folder)
    assert result.exit_code == 1
    assert "whole.pt" in result.stderr and "saved whole" in result.stderr
    assert "holds no tensors" not in result.stderr


def test_summary_pairs_each_folders_model_with_the_previous_folders_model(two_checkpoints):
    result = run("report", "--summary", "--json", two_checkpoints / "checkpoint-*")
    assert result.exit_code == 0, result.stderr
    rows = {Path(r["file"]).relative_to(two_checkpoints).as_posix(): r
            for r in map(json.loads, result.stdout.splitlines())}
    assert set(rows) == {f"checkpoint-{s}/{n}" for s in (100, 200)
                         for n in ("model.safetensors", "optimizer.pt", "scheduler.pt")}
    model = rows["checkpoint-200/model.safetensors"]
    assert model["previous"] == str(two_checkpoints / "checkpoint-100" / "model.safetensors")
    assert {c["name"] for c in model["changes"]} == set(LAYERS)
    assert all(c["ratio"] == pytest.approx(3.0) for c in model["changes"])
    assert rows["checkpoint-200/optimizer.pt"]["previous"] == str(two_checkpoints / "checkpoint-100" / "optimizer.pt")
    assert rows["checkpoint-100/model.safetensors"]["previous"] is None
    table = run("report", "--summary", two_checkpoints / "checkpoint-*")
    assert table.exit_code == 0, table.stderr
    assert "checkpoint-100/model.safetensors → checkpoint-200/model.safetensors" in table.stdout
    assert "optimizer.pt → checkpoint-200/model" not in table.stdout


def test_out_dir_of_a_trainer_checkpoint_is_a_whole_checkpoint(two_checkpoints, tmp_path):
    folder = two_checkpoints / "checkpoint-100"
    out = tmp_path / "out"
    result = run("global", "--clip", "1", "--json", "--out-dir", out, folder)
    assert result.exit_code == 0, result.stderr
    reports = {Path(r["file"]).name: r for r in map(json.loads, result.stdout.splitlines())}
    assert set(reports) == {"model.safetensors", "optimizer.pt", "scheduler.pt"}
    assert reports["model.safetensors"]["copied"] == [
        "config.json", "generation_config.json", "hf_quant_config.json", "rng_state.pth", "special_tokens_map.json",
        "tokenizer.json", "tokenizer_config.json", "trainer_state.json", "training_args.bin"]
    for name in [*SIDE_FILES, "rng_state.pth", "training_args.bin", "trainer_state.json"]:
        assert (out / name).read_bytes() == (folder / name).read_bytes(), name
    clipped = read_all(out / "model.safetensors")
    assert np.sqrt(sum(np.sum(t.astype(np.float64) ** 2) for t in clipped.values())) == pytest.approx(1.0, rel=1e-6)
    again = run("global", "--clip", "1", "--out-dir", out, folder)
    assert again.exit_code == 1 and "config.json: output already exists" in again.stderr


def test_out_dir_of_a_sharded_trainer_checkpoint_copies_its_files_without_tensors(tmp_path):
    folder = tmp_path / "checkpoint-300"
    index = sharded(folder)
    torch_script(TRAINER, folder, 0)
    result = run("global", "--clip", "1", "--json", "--out-dir", tmp_path / "out", folder)
    assert result.exit_code == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["file"] == str(index)
    # scheduler.pt holds numbers, no weights: copied as with a single model.safetensors
    assert report["copied"] == ["rng_state.pth", "scheduler.pt", "trainer_state.json", "training_args.bin"]
    assert report["not_copied"] == [{"name": "optimizer.pt", "reason": "weights tclip did not clip"}]
    for name in ("rng_state.pth", "scheduler.pt", "training_args.bin"):
        assert (tmp_path / "out" / name).read_bytes() == (folder / name).read_bytes()


# ------------------------------------------------------------------ save_pretrained folders


def test_out_dir_of_a_save_pretrained_folder_keeps_its_side_files(tmp_path):
    folder = pretrained(tmp_path / "model")
    result = run("global", "--clip", "1", "--out-dir", tmp_path / "out", folder)
    assert result.exit_code == 0, result.stderr
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == sorted([*SIDE_FILES, "model.safetensors"])
    assert all((tmp_path / "out" / n).read_text() == text for n, text in SIDE_FILES.items())
    assert "copied 6 other file(s) of the checkpoint's folder" in result.stdout
    dry = run("global", "--clip", "1", "--dry-run", "--json", "--force", "--out-dir", tmp_path / "out", folder)
    copies = json.loads(dry.stdout)["would_write"]["copies"]
    assert sorted(Path(c["output"]).name for c in copies) == sorted(SIDE_FILES) and all(c["exists"] for c in copies)
    said = run("global", "--clip", "1", "--dry-run", "--out-dir", tmp_path / "new", folder)
    assert f"would write {tmp_path / 'new' / 'model.safetensors'}, and copy 6 other file(s) of its folder;" in said.stdout


def test_from_pretrained_loads_the_clipped_folder(tmp_path):
    if find_spec("transformers") is None:
        pytest.skip("the test extra installs transformers")
    script = textwrap.dedent("""
        import sys, torch
        from transformers import LlamaConfig, LlamaForCausalLM
        torch.manual_seed(0)
        config = LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                             num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=32)
        if sys.argv[1] == "save":
            LlamaForCausalLM(config).save_pretrained(sys.argv[2])
        else:
            model = LlamaForCausalLM.from_pretrained(sys.argv[2], local_files_only=True)
            total = sum(float(p.detach().double().square().sum()) for p in model.state_dict().values())
            assert abs(total ** 0.5 - 1) < 1e-5, total ** 0.5
    """)
    torch_script(script, "save", tmp_path / "model")
    result = run("global", "--clip", "1", "--out-dir", tmp_path / "out", tmp_path / "model")
    assert result.exit_code == 0, result.stderr
    assert (tmp_path / "out" / "config.json").exists()
    torch_script(script, "load", tmp_path / "out")


# ------------------------------------------------------------------ diff takes folders


def test_diff_takes_two_folders_as_the_other_commands_do(tmp_path, two_checkpoints):
    a, b = pretrained(tmp_path / "a"), pretrained(tmp_path / "b")
    same = run("diff", a, b)
    assert same.exit_code == 0, same.stderr
    differ = run("diff", two_checkpoints / "checkpoint-100", two_checkpoints / "checkpoint-200")
    assert differ.exit_code == 3, differ.stderr
    assert "comparing model.safetensors" in differ.stderr  # the optimizer's file is left, and said so
    sets = run("diff", sharded(tmp_path / "s1").parent, sharded(tmp_path / "s2").parent)
    assert sets.exit_code == 0, sets.stderr


# ------------------------------------------------------------------ quoted globs of folders and indexes


@pytest.mark.parametrize("pattern", ["ckpt-*", "ckpt-*/model.safetensors.index.json", "ckpt-*/*"])
def test_a_glob_of_set_folders_or_indexes_gives_the_sets(tmp_path, pattern):
    for step in (1, 2):
        sharded(tmp_path / f"ckpt-{step}")
    result = run("report", "--json", str(tmp_path / pattern))
    assert result.exit_code == 0, result.stderr
    files = [json.loads(line)["file"] for line in result.stdout.splitlines()]
    assert files == [str(tmp_path / f"ckpt-{s}" / "model.safetensors.index.json") for s in (1, 2)]
    one_by_one = run("report", "--json", tmp_path / "ckpt-1", tmp_path / "ckpt-2")
    assert [json.loads(line)["global_norm"] for line in result.stdout.splitlines()] == \
        [json.loads(line)["global_norm"] for line in one_by_one.stdout.splitlines()]
