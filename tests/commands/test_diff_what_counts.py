"""``diff``: what counts as a difference, what a hint offers, and columns never dropped silently.

A set's derived index keys (``total_size``, ``total_parameters``) are bookkeeping, not
differences; ``--tensors-only`` lists metadata differences without counting them (an F32
GGUF against its safetensors source); a ``--map`` hint is offered only when it pairs a
real share of the names; at 80 columns ``diff`` and ``info`` say which columns they left out."""

from __future__ import annotations

import io
import json
import re
from pathlib import Path

import numpy as np
import pytest
from rich.console import Console

from support.cli import run
from support.formats_helpers import safetensors_bytes
from tclip.cli.render.diff import render_diff
from tclip.cli.render.info import render_info
from tclip.work.diff import diff_files
from tclip.work.clip import file_info

NAMES = [f"model.layers.{i}.self_attn.{p}_proj.weight" for i in range(3) for p in "qkv"] + ["lm_head.weight"]


def tensors(seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {n: rng.standard_normal((4, 8)).astype(np.float32) for n in NAMES}


# ------------------------------------------------------------------ derived index keys


def test_a_bin_set_against_the_safetensors_set_of_the_same_model(tmp_path):
    torch = pytest.importorskip("torch")
    values = tensors()
    halves = [NAMES[:5], NAMES[5:]]
    bins, sts = tmp_path / "bin", tmp_path / "st"
    bins.mkdir()
    sts.mkdir()
    bin_map, st_map = {}, {}
    for i, names in enumerate(halves, 1):
        shard = f"pytorch_model-0000{i}-of-00002.bin"
        torch.save({n: torch.from_numpy(values[n]) for n in names}, bins / shard)
        bin_map.update(dict.fromkeys(names, shard))
        shard = f"model-0000{i}-of-00002.safetensors"
        (sts / shard).write_bytes(safetensors_bytes({n: values[n] for n in names}, {"format": "pt"}))
        st_map.update(dict.fromkeys(names, shard))
    size = sum(v.nbytes for v in values.values())
    # As transformers writes them: the .bin index of an older save, the safetensors one of a newer.
    (bins / "pytorch_model.bin.index.json").write_text(json.dumps({"metadata": {"total_size": size},
                                                                   "weight_map": bin_map}))
    (sts / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_parameters": sum(v.size for v in values.values()), "total_size": size},
         "weight_map": st_map}))
    result = run("diff", bins / "pytorch_model.bin.index.json", sts / "model.safetensors.index.json")
    assert result.exit_code == 0, result.output
    assert "metadata" not in result.stdout
    other = json.loads((sts / "model.safetensors.index.json").read_text())
    other["metadata"]["license"] = "apache-2.0"  # a key that is not derived still counts
    (sts / "model.safetensors.index.json").write_text(json.dumps(other))
    result = run("diff", bins / "pytorch_model.bin.index.json", sts / "model.safetensors.index.json")
    assert result.exit_code == 3 and "file metadata: license: (none)  vs  apache-2.0" in result.stdout


# ------------------------------------------------------------------ --tensors-only


def gguf_and_source(tmp_path: Path, seed: int = 0) -> tuple[Path, Path]:
    gguf = pytest.importorskip("gguf")
    values = tensors()
    source = tmp_path / "model.safetensors"
    source.write_bytes(safetensors_bytes(values, {"format": "pt"}))
    values = tensors(seed)
    path = tmp_path / "model-f32.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_name("tiny")
    writer.add_block_count(3)
    writer.add_context_length(128)
    writer.add_embedding_length(8)
    writer.add_file_type(0)
    for name, array in values.items():
        writer.add_tensor(name, array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path, source


def test_tensors_only_lists_metadata_but_does_not_count_it(tmp_path):
    path, source = gguf_and_source(tmp_path)
    plain = run("diff", path, source)
    assert plain.exit_code == 3 and "7 metadata differences" in plain.stdout  # as before: metadata counts
    result = run("diff", "--tensors-only", path, source)
    assert result.exit_code == 0, result.output
    assert "file metadata: general.architecture: llama  vs  (none)" in result.stdout  # still shown
    assert re.search(r"^same: 10 compared, 0 differ, 7 metadata differences \(not counted: --tensors-only\)",
                     result.stdout, re.M), result.stdout
    data = json.loads(run("diff", "--tensors-only", "--json", path, source).stdout)
    assert data["verdict"] == "same" and data["same"] is True and data["tensors_only"] is True
    assert len(data["metadata_differences"]) == 7
    assert json.loads(run("diff", "--json", path, source).stdout)["tensors_only"] is False


def test_tensors_only_still_fails_on_a_tensor(tmp_path):
    path, source = gguf_and_source(tmp_path, seed=1)
    result = run("diff", "--tensors-only", path, source)
    assert result.exit_code == 3 and "differ: 10 compared, 10 differ" in result.stdout
    assert diff_files(path, source, tensors_only=True).verdict.value == "differ"


# ------------------------------------------------------------------ --map hints


def test_a_map_hint_that_pairs_one_of_21_is_not_offered(tmp_path):
    a = {f"encoder.block.{i}.dense.weight": np.ones((2, 2), np.float32) for i in range(20)}
    a["head.proj.weight"] = np.ones((2, 2), np.float32)
    b = {f"decoder.layer.{i}.mlp.weight": np.ones((2, 2), np.float32) for i in range(20)}
    b["lm.proj.weight"] = np.ones((2, 2), np.float32)
    (tmp_path / "a.safetensors").write_bytes(safetensors_bytes(a))
    (tmp_path / "b.safetensors").write_bytes(safetensors_bytes(b))
    result = run("diff", tmp_path / "a.safetensors", tmp_path / "b.safetensors")
    assert result.exit_code == 3
    assert "no tensor names pair up" in result.stderr and "--map" not in result.stderr, result.stderr


def test_a_map_hint_that_pairs_most_names_is_offered(tmp_path):
    a = {f"module.model.layers.{i}.w": np.ones(2, np.float32) for i in range(20)}
    a["module.extra"] = np.ones(2, np.float32)
    b = {f"model.layers.{i}.w": np.ones(2, np.float32) for i in range(20)}
    (tmp_path / "a.safetensors").write_bytes(safetensors_bytes(a))
    (tmp_path / "b.safetensors").write_bytes(safetensors_bytes(b))
    result = run("diff", tmp_path / "a.safetensors", tmp_path / "b.safetensors")
    assert "--map 'module.*=*' would pair 20 of 21" in result.stderr, result.stderr


# ------------------------------------------------------------------ columns left out at 80 columns


def llama_pair(tmp_path: Path) -> tuple[Path, Path]:
    names = [f"model.layers.{i}.self_attn.{p}_proj.weight" for i in (7, 17) for p in "qkv"]
    rng = np.random.default_rng(0)
    a = {n: rng.standard_normal((64, 64)).astype(np.float32) for n in names}
    b = {n: v * np.float32(1.001) for n, v in a.items()}
    (tmp_path / "a.safetensors").write_bytes(safetensors_bytes(a))
    (tmp_path / "b.safetensors").write_bytes(safetensors_bytes(b))
    return tmp_path / "a.safetensors", tmp_path / "b.safetensors"


def screen(render, *args, width: int, **kwargs) -> str:
    console = Console(file=io.StringIO(), width=width, color_system=None)
    render(*args, console, width=width, **kwargs)
    return console.file.getvalue()


DIFF_HEADERS = ["shape", "dtype", "‖a−b‖", "relative", "max |a−b|", "cosine", "differ", "NaN/Inf≠"]


@pytest.mark.parametrize("width", [80, 120])
def test_diff_says_which_columns_it_left_out(tmp_path, monkeypatch, width):
    monkeypatch.chdir(tmp_path)
    llama_pair(Path("."))
    text = screen(render_diff, diff_files("a.safetensors", "b.safetensors"), width=width)
    lines = text.splitlines()
    assert all(len(line) <= width for line in lines), text
    note = [line for line in lines if line.startswith(f"left out at {width} columns: ")]
    assert len(note) == 1, text
    for header in DIFF_HEADERS:  # every column is either shown or named as left out
        assert (header in lines[1]) != (header in note[0]), (header, text)
    if width == 80:
        assert "cosine" in note[0] and "max |a−b|" in note[0]


def test_info_says_which_columns_it_left_out_at_80_columns(tmp_path):
    names = [f"model.layers.{i}.self_attn.rotary_embedding_inverse_frequency_table.weight" for i in (7, 17)]
    path = tmp_path / "m.safetensors"
    path.write_bytes(safetensors_bytes({n: np.ones((4096, 128), np.float32) for n in names}))
    info = file_info(path)
    narrow = screen(render_info, info, width=80)
    note = [line for line in narrow.splitlines() if line.startswith("left out at 80 columns: ")]
    assert len(note) == 1 and "bytes" in note[0], narrow
    assert "bytes" not in narrow.splitlines()[1]
    wide = screen(render_info, info, width=120)
    assert "left out" not in wide and "bytes" in wide.splitlines()[1]


# ------------------------------------------------------------------ the verdict and the exit status


def test_diff_exit_status_and_json_verdict_agree(tmp_path):
    base = tensors()
    files = {
        "a": (base, None),
        "same": (base, None),
        "differ": ({**base, NAMES[0]: base[NAMES[0]] + 1}, None),
        "incomplete": ({**base, NAMES[0]: base[NAMES[0]] > 0}, None),  # bool against numbers
        "metadata": (base, {"note": "fine-tuned"}),
    }
    for name, (values, metadata) in files.items():
        (tmp_path / f"{name}.safetensors").write_bytes(safetensors_bytes(values, metadata))
    expected = {"same": "same", "differ": "differ", "incomplete": "incomplete", "metadata": "differ"}
    for name, verdict in expected.items():
        for extra, wanted in (([], verdict), (["--tensors-only"], "same" if name == "metadata" else verdict)):
            result = run("diff", "--json", *extra, tmp_path / "a.safetensors", tmp_path / f"{name}.safetensors")
            data = json.loads(result.stdout)
            assert data["verdict"] == wanted, (name, extra, data["verdict"])
            assert result.exit_code == (0 if data["verdict"] == "same" else 3), (name, extra)
            assert data["same"] == (data["verdict"] == "same")
