"""Names are data: a name of millions of characters (a ``torch.save`` key, a safetensors header
key, an npz member at the zip's 65,535-byte limit, a GGUF tensor name at the spec's) is shown
shortened in people's output -- its start and end around ``…(5,000,031 chars)…`` -- so a table's
layout never works through it, while ``--json`` keeps it whole (scripts join on names)."""

from __future__ import annotations

import json
import subprocess
import sys
import zipfile
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from support import gguf_helpers as gh
from support.cli import run, run80
from support.formats_helpers import safetensors_bytes

HUGE = "model.layers.0.self_attn." + "k" * 5_000_000 + ".weight"
SHORT = "model.layers.0.self_attn.q_proj.weight"
ZIP_LONGEST = "model.layers.0." + "k" * 60_000 + ".weight"  # a zip member name holds at most 65,535 bytes


def _safetensors(path: Path) -> str:
    path.write_bytes(safetensors_bytes({HUGE: np.full((2, 2), 0.5, np.float32),
                                        SHORT: np.full((2, 2), 0.25, np.float32)}))
    return HUGE


def _pt(path: Path) -> str:
    pytest.importorskip("torch")
    names = path.with_suffix(".names.json")  # (one argument holds at most 128 kB)
    names.write_text(json.dumps([HUGE, SHORT]))
    code = ("import json, sys, torch\n"
            "huge, short = json.load(open(sys.argv[2]))\n"
            "torch.save({huge: torch.full((2, 2), 0.5), short: torch.full((2, 2), 0.25)}, sys.argv[1])")
    subprocess.run([sys.executable, "-c", code, str(path), str(names)], check=True)
    names.unlink()
    return HUGE


def _npz(path: Path) -> str:
    np.savez(path, **{ZIP_LONGEST: np.full((2, 2), 0.5, np.float32), SHORT: np.full((2, 2), 0.25, np.float32)})
    with zipfile.ZipFile(path) as archive:
        assert f"{ZIP_LONGEST}.npy" in archive.namelist()
    return ZIP_LONGEST


def _gguf(path: Path) -> str:
    name = "blk.0." + "k" * 65_000 + ".weight"
    gh.write_gguf(path, gh.GgufSpec(tensors=[gh.Tensor(name, (2, 2), 0, np.full(4, 0.5, np.float32).tobytes()),
                                             gh.Tensor("blk.0.attn_q.weight", (2, 2), 0,
                                                       np.full(4, 0.25, np.float32).tobytes())]))
    return name


FILES: dict[str, tuple[str, Callable[[Path], str]]] = {
    "safetensors": ("model.safetensors", _safetensors),
    "pt": ("model.pt", _pt),
    "npz": ("model.npz", _npz),
    "gguf": ("model.gguf", _gguf),
}


_MADE: dict[str, tuple[bytes, str]] = {}  # each file is made once (torch starts in 2 s)


def _made(tmp_path: Path, kind: str) -> tuple[Path, str]:
    file_name, make = FILES[kind]
    path = tmp_path / file_name
    if kind not in _MADE:
        name = make(path)
        _MADE[kind] = path.read_bytes(), name
    path.write_bytes(_MADE[kind][0])
    return path, _MADE[kind][1]


def _marker(name: str) -> str:
    return f"…({len(name):,} chars)…"


@pytest.mark.parametrize("command", [["info"], ["report"], ["report", "--stats"], ["global", "--clip", "1"],
                                     ["report", "--max-norm", "0.1"]],
                         ids=["info", "report", "report-stats", "global", "gate"])
@pytest.mark.parametrize("terminal", [run, run80], ids=["pipe", "80-columns"])
@pytest.mark.parametrize("kind", sorted(FILES))
def test_a_huge_name_is_shown_shortened_with_its_length(tmp_path, kind, command, terminal):
    path, name = _made(tmp_path, kind)
    result = terminal(*command, path)
    assert result.exit_code in (0, 3), result.output
    lines = result.output.splitlines()
    assert len(result.output) < 20_000 and max(len(line) for line in lines) < 2_000, \
        (len(result.output), max(len(line) for line in lines))
    if terminal is run:  # in a pipe, the table's row: the name's start and end around its length
        assert any(line.startswith(name[:100]) and _marker(name) in line and name[-50:] in line for line in lines), \
            [line[:120] for line in lines]


@pytest.mark.parametrize("kind", sorted(FILES))
def test_json_keeps_the_whole_name(tmp_path, kind):
    path, name = _made(tmp_path, kind)
    report = run("report", "--json", path)
    assert report.exit_code == 0, report.stderr
    names = [t["name"] for t in json.loads(report.stdout)["tensors"]]
    assert name in names and "chars)" not in "".join(names)
    info = run("info", "--json", path)
    assert name in [t["name"] for t in json.loads(info.stdout.splitlines()[0])["tensors"]]


def test_a_name_within_the_limit_is_shown_whole(tmp_path):
    name = "model.layers.0." + "k" * 900 + ".weight"
    path = tmp_path / "model.safetensors"
    path.write_bytes(safetensors_bytes({name: np.ones(2, np.float32)}))
    result = run("report", path)
    assert result.exit_code == 0 and name in result.stdout and "chars)" not in result.stdout
