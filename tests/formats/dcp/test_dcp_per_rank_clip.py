"""Clipping a DCP checkpoint saved per rank (``__R.metadata`` files, or DCP's Hugging Face
``shard-*`` pieces) is refused in one line with nothing written: the writer rewrites a folder
described by one ``.metadata``, which these folders do not have."""

from __future__ import annotations

from pathlib import Path

import pytest

from support.cli import run
from support.dcp_helpers import expected


@pytest.mark.parametrize("kind", ["rank_meta", "hf_ranks2"])
@pytest.mark.parametrize("how", [["--out-dir", "OUT"], ["--in-place"]])
def test_a_clip_of_a_per_rank_folder_is_refused(hf_root: Path, tmp_path: Path, kind: str, how: list[str]) -> None:
    folder = expected(hf_root, kind)[0]
    before = {p.name: p.read_bytes() for p in folder.iterdir()}
    out = tmp_path / "out"
    result = run("global", str(folder), "--clip", "0.5", *[str(out) if a == "OUT" else a for a in how])
    assert result.exit_code == 1, result.output
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("Error: ") and "saved per rank" in lines[0], result.output
    assert "Traceback" not in result.output
    assert not out.exists() or not any(out.iterdir())
    assert {p.name: p.read_bytes() for p in folder.iterdir()} == before
