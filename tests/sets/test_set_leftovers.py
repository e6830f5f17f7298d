"""Leftovers of tensor sets (issue 28.12, 28.16): a companion file that turns into a FIFO
during pass 2, a commit marker a resumed run left, a broken split set's error said twice,
other frameworks' weight files copied into ``--out-dir``."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from support.cli import run
from support.sets import interrupted, sharded
from tclip.formats.atomic import write_marker
from tclip.work.journal import commit_marker


@pytest.mark.slow  # waits out a stalled read
def test_a_companion_swapped_for_a_fifo_during_pass_2_is_one_error_not_a_hang(tmp_path):
    index = sharded(tmp_path / "ckpt")
    (index.parent / "config.json").write_text('{"model_type": "llama"}\n')
    driver = (
        "import os, sys, threading\n"
        "from pathlib import Path\n"
        "from tclip.work import clip as sets\n"
        "real = sets.rewrite_task\n"
        "once = threading.Lock()  # the shards' tasks run on several threads: one of them swaps\n"
        "def swap_then_rewrite(*args, **kwargs):\n"
        "    config = Path(sys.argv[1]).parent / 'config.json'\n"
        "    with once:\n"
        "        if not config.is_fifo():  # listed as a regular file in pass 1; a FIFO when copied\n"
        "            config.unlink()\n"
        "            os.mkfifo(config)\n"
        "    return real(*args, **kwargs)\n"
        "sets.rewrite_task = swap_then_rewrite\n"
        "from tclip.cli import cli\n"
        "cli(['global', '--clip', '1', '--out-dir', sys.argv[2], sys.argv[1]])\n"
    )
    out = tmp_path / "out"
    try:
        result = subprocess.run([sys.executable, "-c", driver, str(index), str(out)], capture_output=True, text=True,
                                timeout=60)
    except subprocess.TimeoutExpired:
        pytest.fail("the copy of a FIFO blocked the run")
    assert result.returncode == 1, result.stderr
    assert result.stderr.splitlines() == [
        f"Error: {index.parent / 'config.json'}: is no longer a regular file (a FIFO, device or socket is never "
        "read); nothing was written"]
    assert not out.exists() or not list(out.iterdir())  # the shards it wrote were removed


def test_a_resumed_run_leaves_no_commit_marker(tmp_path, monkeypatch):
    """Killed after the journal recorded a shard and before its marker was removed: the
    resumed run skips that shard, and must still remove its marker."""
    index, _ = interrupted(tmp_path, monkeypatch)
    journal = index.with_name(index.name + ".tclip-journal")
    done = json.loads(journal.read_text())["done"]
    assert done
    shard = index.parent / done[0]
    write_marker(commit_marker(shard), os.stat(shard))  # what the kill left
    result = run("global", "--clip", "1", "--in-place", index)
    assert result.exit_code == 0, result.stderr
    assert "resumed an unfinished run" in result.stderr
    assert not [p.name for p in index.parent.iterdir() if p.name.startswith(".")]


def test_a_folder_holding_one_broken_split_set_says_its_error_once(tmp_path):
    from support.gguf_helpers import split_set

    split_set(tmp_path / "model")
    broken = tmp_path / "model" / "llama-3-8b-Q4_K_M-00002-of-00003.gguf"
    broken.write_bytes(broken.read_bytes()[:100])
    for command in (["report"], ["global", "--clip", "1", "--out-dir", str(tmp_path / "out")]):
        result = run(*command, tmp_path / "model")
        assert result.exit_code == 1
        lines = result.stderr.splitlines()
        assert len(lines) == 1 and lines[0].startswith(f"Error: {broken}: truncated GGUF header"), lines


def test_other_frameworks_weights_are_not_copied_into_out_dir(tmp_path):
    index = sharded(tmp_path / "ckpt")
    folder = index.parent
    (folder / "config.json").write_text("{}\n")
    (folder / "flax_model.msgpack").write_bytes(b"\x81\xa5model\x80")  # Flax's serialized weights
    (folder / "rust_model.ot").write_bytes(b"PK\x03\x04")
    (folder / "tf_model.h5").write_bytes(b"\x89HDF\r\n\x1a\n" + bytes(8))
    result = run("global", "--clip", "1", "--json", "--out-dir", tmp_path / "out", index)
    assert result.exit_code == 0, result.stderr
    data = json.loads(result.stdout)
    assert data["copied"] == ["config.json"]
    assert {"name": "flax_model.msgpack", "reason": "weights tclip did not clip"} in data["not_copied"]
    assert {"name": "rust_model.ot", "reason": "weights tclip did not clip"} in data["not_copied"]
    assert {"name": "tf_model.h5", "reason": "weights tclip did not clip"} in data["not_copied"]
    assert not (tmp_path / "out" / "flax_model.msgpack").exists()
