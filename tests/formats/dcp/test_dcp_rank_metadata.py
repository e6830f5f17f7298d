"""DCP folders saved without rank coordination (``dcp.save(..., use_collectives=False)``): a
``__R.metadata`` per rank and no ``.metadata``, the ranks' metadata merged and read as one.

The folder is written by the real ``torch.distributed.checkpoint`` on two gloo ranks
(:mod:`dcp_hf_helpers`, kind ``rank_meta``): ``Shard(0)`` (uneven), ``Shard(1)``, ``Replicate()``
DTensors and a plain 0-d tensor; without coordination every rank saves the replicated tensor and
the 0-d one.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest

from support.cli import run
from support.dcp_hf_helpers import NORM, SCALE, W1, WO, WQ
from support.dcp_helpers import expected
from tclip.formats import open_reader, registry
from tclip.formats.dcp import Reader
from tclip.formats.torch.pickled import TORCH_DTYPES


def values(arrays: dict, meta: dict, name: str) -> np.ndarray:
    info = meta["tensors"][name]
    return arrays[name].view(TORCH_DTYPES[info["dtype"]]).reshape(info["shape"])


def test_the_ranks_metadata_merged_gives_every_whole_tensor(hf_root: Path) -> None:
    folder, arrays, meta = expected(hf_root, "rank_meta")
    assert sorted(p.name for p in folder.iterdir()) == ["__0.metadata", "__0_0.distcp", "__1.metadata",
                                                         "__1_0.distcp"]
    assert registry.detect_format(folder / "__1.metadata") == "dcp"
    for given in (folder, folder / "__0.metadata", folder / "__1.metadata"):
        with (Reader(given) if given.is_dir() else open_reader(given)) as reader:
            assert reader.path == folder
            assert set(reader.tensors) == {WQ, W1, WO, NORM, SCALE}
            for name, info in reader.tensors.items():
                want = values(arrays, meta, name)
                assert info.shape == want.shape and info.dtype == want.dtype, name
                assert reader.read(name).tobytes() == want.tobytes(), name
            assert reader.chunk_files(WQ) == ["__0_0.distcp", "__1_0.distcp"]
            assert reader.chunk_files(NORM) == ["__0_0.distcp"]  # saved by both ranks: read from the lowest
            assert reader.chunk_files(SCALE) == ["__0_0.distcp"]


def test_report_and_info_on_the_folder(hf_root: Path) -> None:
    folder, arrays, meta = expected(hf_root, "rank_meta")
    result = run("report", "--json", folder)
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout.splitlines()[0])
    measured = {t["name"]: t["norm"] for t in report["tensors"]}
    total = 0.0
    for name in meta["tensors"]:
        want = math.sqrt(float(np.sum(np.square(values(arrays, meta, name).astype(np.float64)))))
        assert measured[name] == pytest.approx(want, rel=1e-12, abs=0), name
        total += want * want
    assert report["global_norm"] == pytest.approx(math.sqrt(total), rel=1e-12)
    info = run("info", folder)
    assert info.exit_code == 0 and "257×3" in info.stdout and "5 tensors, 842 parameters" in info.stdout


def test_the_same_as_the_hugging_face_pieces_of_the_same_state(hf_root: Path) -> None:
    result = run("diff", hf_root / "rank_meta" / "ckpt", hf_root / "hf_ranks2" / "ckpt")
    assert result.exit_code == 0, result.output
    assert "5 tensor(s) equal (exact)" in result.stdout


def test_convert_writes_the_weights_and_copies_no_rank_file(hf_root: Path, tmp_path: Path) -> None:
    folder = hf_root / "rank_meta" / "ckpt"
    result = run("convert", folder, tmp_path / "hf")
    assert result.exit_code == 0, result.output
    assert sorted(p.name for p in (tmp_path / "hf").iterdir()) == ["model.safetensors"]
    result = run("diff", folder, tmp_path / "hf")
    assert result.exit_code == 0, result.output
    assert "5 tensor(s) equal (exact)" in result.stdout


BROKEN = {
    "shape": "__1.metadata: the ranks' metadata disagree about 'model.layers.0.attention.wq.weight' "
             "(torch.float32 [7, 4] and torch.float32 [8, 4])",
    "overlap": "the ranks' metadata: the chunks of 'model.layers.0.attention.wq.weight' (shape [7, 4]) overlap",
    "missing_rank": "no __0.metadata, though ranks up to 1 saved theirs: part of the checkpoint is missing",
}


@pytest.mark.parametrize("case", sorted(BROKEN))
def test_broken_folder_is_one_error_line(hf_root: Path, case: str) -> None:
    folder = hf_root / "rank_meta" / "broken" / case
    result = run("report", folder)
    assert result.exit_code == 1, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"Error: {folder}: "), result.stderr
    assert BROKEN[case] in lines[0]
    assert "Traceback" not in result.output
