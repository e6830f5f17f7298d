"""A DCP tensor sharded by rows (``Shard(0)``, as FSDP shards) is converted by copying each shard's
bytes in the kernel, as a tensor stored in one run is; any other split is read and written in
blocks. Either way the output holds what torch loads back, bit for bit."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file

from support import dcp_helpers
from support.dcp_helpers import expected
from tclip.formats import base
from tclip.formats.base import _tile
from tclip.formats.dcp import Reader
from tclip.formats.torch.pickled import TORCH_DTYPES
from tclip.work.convert import convert

WQ = "model.layers.0.attention.wq.weight"     # 7x4 float32 on Shard(0): rows 0-3 and 4-6
W1 = "model.layers.0.feed_forward.w1.weight"  # 257x3 bfloat16 on Shard(0): 129 + 128 rows
WO = "model.layers.0.attention.wo.weight"     # 3x9 float32 on Shard(1): 5 + 4 columns


@pytest.fixture(scope="module")
def ranks2(tmp_path_factory: pytest.TempPathFactory) -> Path:
    pytest.importorskip("torch")
    root = tmp_path_factory.mktemp("dcp-rows")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(OMP_NUM_THREADS="1", PYTHONHASHSEED="0")
    subprocess.run([sys.executable, dcp_helpers.__file__, str(root), "ranks2"], check=True, env=env, timeout=600,
                   capture_output=True)
    return root


def test_row_shards_are_runs_and_column_shards_are_not(ranks2: Path) -> None:
    folder, _, _ = expected(ranks2, "ranks2")
    with Reader(folder) as reader:
        wq = reader.runs(WQ)
        assert wq is not None and [(first, count) for first, count, _, _ in wq] == [(0, 4 * 4 * 4), (64, 3 * 4 * 4)]
        assert [os.pread(fd, count, offset) for _, count, fd, offset in wq] \
            == [reader.read(WQ)[:4].tobytes(), reader.read(WQ)[4:].tobytes()]
        w1 = reader.runs(W1)
        assert w1 is not None and [count for _, count, _, _ in w1] == [129 * 3 * 2, 128 * 3 * 2]
        assert reader.runs(WO) is None


def test_convert_copies_row_shards_in_the_kernel(ranks2: Path, tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    copied: list[tuple[int, int]] = []  # (offset in the output, byte count)
    original = base.copy_range

    def counted(source_fd: int, source_offset: int, count: int, target_fd: int, target_offset: int,
                path: object, writeback: bool = False) -> None:
        copied.append((target_offset, count))
        original(source_fd, source_offset, count, target_fd, target_offset, path, writeback)

    monkeypatch.setattr(base, "copy_range", counted)
    folder, arrays, meta = expected(ranks2, "ranks2")
    convert(folder, tmp_path / "hf")
    out = tmp_path / "hf" / "model.safetensors"
    got = load_file(str(out))
    assert set(got) == set(meta["tensors"])
    for name in meta["tensors"]:
        info = meta["tensors"][name]
        want = arrays[name].view(TORCH_DTYPES[info["dtype"]]).reshape(info["shape"])
        assert got[name].shape == want.shape and got[name].tobytes() == want.tobytes(), name
    raw = out.read_bytes()
    header_end = 8 + int.from_bytes(raw[:8], "little")
    starts = {name: header_end + entry["data_offsets"][0]
              for name, entry in json.loads(raw[8:header_end]).items() if name != "__metadata__"}
    assert [c for c in copied if starts[WQ] <= c[0] < starts[WQ] + 7 * 4 * 4] == [(starts[WQ], 64),
                                                                                  (starts[WQ] + 64, 48)]
    assert [c for c in copied if starts[W1] <= c[0] < starts[W1] + 257 * 3 * 2] == [(starts[W1], 774),
                                                                                   (starts[W1] + 774, 768)]
    assert not [c for c in copied if starts[WO] <= c[0] < starts[WO] + 3 * 9 * 4]  # read and written in blocks


def test_runs_must_cover_the_tensor_once_in_order() -> None:
    assert _tile([(0, 8, 3, 0), (8, 4, 4, 100)], 12)
    assert not _tile([(0, 8, 3, 0), (8, 4, 4, 100)], 16)   # a part missing at the end
    assert not _tile([(0, 8, 3, 0), (4, 8, 4, 100)], 12)   # overlapping
    assert not _tile([(8, 4, 4, 100), (0, 8, 3, 0)], 12)   # out of order
    assert not _tile([(0, 0, 3, 0), (0, 12, 4, 0)], 12)    # an empty run
    assert not np.any([_tile([], 4)])
