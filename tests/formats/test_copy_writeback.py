"""A tensor copied in the kernel into a new file (``PositionalWriter.copy_region``, a DCP row
shard) starts its write-back piece by piece as it goes, as written blocks do, so that the final
fsync finds most of the file already on its way to the disk."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from tclip.formats import _io
from tclip.work.convert import convert


def test_kernel_copies_start_their_write_back_in_pieces(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    rng = np.random.default_rng(5)
    tensors = {"model.layers.17.self_attn.k_proj.weight": rng.standard_normal((300, 1000)).astype(np.float32),
               "model.layers.17.self_attn.v_proj.weight": rng.standard_normal((7, 5)).astype(np.float32)}
    save_file(tensors, str(tmp_path / "model.safetensors"))
    started: list[tuple[int, int]] = []
    original = _io.start_writeback

    def recorded(fd: int, offset: int, length: int) -> None:
        started.append((offset, length))
        original(fd, offset, length)

    monkeypatch.setattr(_io, "start_writeback", recorded)
    monkeypatch.setattr(_io, "WRITEBACK_PIECE", 256 << 10)
    convert(tmp_path / "model.safetensors", tmp_path / "out.safetensors")
    got = load_file(str(tmp_path / "out.safetensors"))
    assert all(got[name].tobytes() == tensors[name].tobytes() for name in tensors)
    big = 300 * 1000 * 4
    pieces = sorted(length for _, length in started)
    assert pieces.count(256 << 10) == big // (256 << 10) and big % (256 << 10) in pieces and 7 * 5 * 4 in pieces
    size = os.path.getsize(tmp_path / "out.safetensors")
    assert all(0 <= offset and offset + length <= size for offset, length in started)
    data = sorted(started)[1:]  # after the header's, written by pwrite_all at 0
    assert data[0][0] + sum(length for _, length in data) == size  # the copies, piece after piece to the end


def test_pieces_skip_holes_and_a_short_source_still_fails(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from tclip.errors import FormatError
    from tclip.formats._io import copy_range

    monkeypatch.setattr(_io, "WRITEBACK_PIECE", 64 << 10)
    size = 8 << 20
    source, target = tmp_path / "s", tmp_path / "t"
    with open(source, "wb") as f:
        f.truncate(size)
        f.seek(3 << 20)
        f.write(os.urandom(300_000))
    with open(target, "wb") as f:
        f.truncate(size + 4096)
        f.seek(6 << 20)
        f.write(b"x" * 4096)  # not a hole: overwritten with the source's zeros
    fd_in, fd_out = os.open(source, os.O_RDONLY), os.open(target, os.O_RDWR)
    try:
        copy_range(fd_in, 0, size, fd_out, 4096, source, writeback=True)
        with pytest.raises(FormatError, match="truncated"):
            copy_range(fd_in, size - 100, 1 << 20, fd_out, 0, source, writeback=True)
    finally:
        os.close(fd_in)
        os.close(fd_out)
    assert target.read_bytes()[4096:] == source.read_bytes()
