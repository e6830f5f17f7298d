"""Hostile and unusual torch.save files: storages over other zip members, pickles that name
tensors far more often than their bytes could honestly hold, views of huge strides, float8
views, files saved with CRC-32s turned off, and files cut short.

Each case goes through the command line: a right answer, or one ``Error: <file>: ...`` line,
exit 1, and nothing written. Hostile files are built by hand (pickle opcodes, zip bytes);
files torch itself writes come from torch, when it is installed.
"""

from __future__ import annotations

import struct
import zipfile
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

from support import torch_helpers as th
from support.cli import run
from tclip.errors import FormatError, UnsupportedError
from tclip.formats import open_reader
from tclip.formats.torch.archive import load_torch_archive, read_tensor
from tclip.formats.limits import names_within


def refused(path: Path, *args, words: str = "") -> str:
    """The run ends with one ``Error: <file>: ...`` line, exit 1, nothing written beside the file."""
    before = sorted(p.name for p in path.parent.iterdir())
    data = path.read_bytes()
    result = run(*args, path)
    assert result.exit_code == 1, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"Error: {path}: "), lines
    assert words in lines[0], lines[0]
    assert "internal error" not in lines[0]
    assert sorted(p.name for p in path.parent.iterdir()) == before
    assert path.read_bytes() == data
    return lines[0]


def wrap(path: Path, pickle: bytes, storages: dict[str, bytes]) -> Path:
    """A zip laid out as torch writes it (see tests/support/torch_helpers.py) around a hand-made pickle."""
    members = [("data.pkl", pickle), ("byteorder", b"little")]
    members += [(f"data/{key}", data) for key, data in storages.items()]
    members.append(("version", b"3\n"))
    path.write_bytes(th.zip_archive([(f"archive/{name}", data) for name, data in members]))
    return path


def one_tensor(numel: int = 4) -> bytes:
    return th.tensor_opcodes(th.contiguous("0", (numel,)), np.zeros(numel, np.float32))


def put(index: int) -> bytes:
    return b"r" + struct.pack("<I", index)  # LONG_BINPUT


def get(index: int) -> bytes:
    return b"j" + struct.pack("<I", index)  # LONG_BINGET


def central_entry(raw: bytes, name: str) -> int:
    """Where the central directory's entry of member ``name`` starts."""
    position = raw.index(b"PK\x01\x02")
    while raw[position:position + 4] == b"PK\x01\x02":
        name_length, extra_length, comment_length = struct.unpack_from("<3H", raw, position + 28)
        if raw[position + 46:position + 46 + name_length] == name.encode():
            return position
        position += 46 + name_length + extra_length + comment_length
    raise KeyError(name)


# --------------------------------------------------------------------------- item 4: storages over members


def storage_over_the_next_member(tmp_path: Path, cover: int) -> Path:
    """Storage ``data/0`` whose directory entry claims ``cover`` more bytes than it holds, so
    that its data runs over the members after it (its data descriptor, ``byteorder``...)."""
    values = np.arange(1, 5, dtype=np.float32)
    numel = 4 + cover // 4
    pickle = b"\x80\x02" + th.mapping([("w", th.tensor_opcodes(th.contiguous("0", (numel,)),
                                                                np.zeros(numel, np.float32)))]) + b"."
    members = [("data.pkl", pickle), ("data/0", values.tobytes()), ("byteorder", b"little"), ("version", b"3\n")]
    raw = bytearray(th.zip_archive([(f"archive/{name}", data) for name, data in members]))
    entry = central_entry(bytes(raw), "archive/data/0")
    struct.pack_into("<2L", raw, entry + 20, 16 + cover, 16 + cover)  # compressed and real sizes
    path = tmp_path / "over.pt"
    path.write_bytes(bytes(raw))
    return path


def test_a_storage_running_over_the_byteorder_member_is_refused(tmp_path):
    # data/0 is followed by its descriptor (16 bytes) and byteorder's local header (30 bytes + name)
    path = storage_over_the_next_member(tmp_path, 64)
    with zipfile.ZipFile(path) as archive:
        assert [i.filename for i in archive.infolist()][2] == "archive/byteorder"
    refused(path, "norm", "--clip", "1", words="overlap")


def test_a_storage_running_over_the_next_local_header_only_is_refused(tmp_path):
    # 16 bytes of descriptor and 32 of byteorder's 30-byte local header and its name
    path = storage_over_the_next_member(tmp_path, 48)
    message = refused(path, "report", words="overlap")
    assert "archive/data/0" in message


def test_a_storage_holding_another_member_whole_is_refused(tmp_path):
    # the directory sends 'version' into the bytes of storage data/0: it is inside the storage
    values = np.arange(64, dtype=np.float32)
    pickle = b"\x80\x02" + th.mapping([("w", th.tensor_opcodes(th.contiguous("0", (64,)), values))]) + b"."
    inner = th.zip_archive([("archive/version", b"3\n")])
    inner = inner[:inner.index(b"PK\x01\x02")]  # the local header and data of 'version', padded
    storage = inner + b"\0" * (-len(inner) % 4)
    storage += b"\0" * (256 - len(storage))
    members = [("archive/data.pkl", pickle), ("archive/byteorder", b"little"), ("archive/data/0", storage),
               ("archive/version", b"3\n")]
    raw = bytearray(th.zip_archive(members))
    data_start = raw.index(inner, raw.index(b"archive/data/0"))  # inside data/0's bytes
    entry = central_entry(bytes(raw), "archive/version")
    struct.pack_into("<L", raw, entry + 42, data_start)  # the version entry's local header offset
    path = tmp_path / "inside.pt"
    path.write_bytes(bytes(raw))
    with pytest.raises(FormatError, match="'archive/data/0' and 'archive/version' overlap"):
        load_torch_archive(path)
    refused(path, "norm", "--clip", "1", words="overlap")


def test_a_storage_member_of_a_real_file_is_still_read(tmp_path):
    path = th.save_arrays(tmp_path / "ok.pt", {"model.layers.0.self_attn.k_proj.weight": np.ones((4, 4), np.float32)})
    result = run("norm", "--clip", "1", path)
    assert result.exit_code == 0, result.output


# --------------------------------------------------------------------------- item 11: name bombs


def shared_levels(levels: int, fan: int) -> bytes:
    """One tensor, then ``levels`` dicts of ``fan`` keys each holding the dict below it (memo
    GETs): ``fan ** levels`` names from a pickle of a few hundred bytes."""
    pickle = b"\x80\x02" + one_tensor() + put(0) + b"0"
    for level in range(1, levels + 1):
        if level > 1:
            pickle += b"0"
        pickle += b"}(" + b"".join(th.text(f"k{i}") + get(level - 1) for i in range(fan)) + b"u" + put(level)
    return pickle + b"."


def same_tensor_named(count: int) -> bytes:
    """A dict of ``count`` keys whose values are all the same tensor object (memo GETs)."""
    pickle = b"\x80\x02" + one_tensor() + put(0) + b"0"
    return pickle + b"}(" + b"".join(th.text(f"t{i}") + get(0) for i in range(count)) + b"u."


def nested_pairs(levels: int, padding: int) -> bytes:
    """Tuples of pairs (x, x) nested ``levels`` deep (2 ** levels names), after ``padding``
    memo entries that only make the pickle large (and an old work budget with it)."""
    pickle = b"\x80\x02N" + b"".join(put(i) for i in range(padding)) + b"0" + one_tensor() + put(padding)
    for level in range(1, levels + 1):
        pickle += b"0" + get(padding + level - 1) + get(padding + level - 1) + b"\x86" + put(padding + level)
    return pickle + b"."


STORAGE = {"0": np.ones(4, np.float32).tobytes()}


def test_a_small_pickle_naming_one_tensor_ten_thousand_times_is_refused(tmp_path):
    # 10 ** 4 names from ~700 bytes; before: every name read and clipped (seconds, exit 0)
    path = wrap(tmp_path / "fan.pt", shared_levels(4, 10), STORAGE)
    assert path.stat().st_size < 2000
    refused(path, "norm", "--clip", "1", words="names")
    refused(path, "info", words="names")


def test_a_dict_of_more_names_than_memory_allows_is_refused(tmp_path):
    # 10 000 real keys (~150 KB of pickle, so honest by size) naming one tensor: more than
    # --memory 16M holds at 4 KiB a name
    path = wrap(tmp_path / "flat.pt", same_tensor_named(10_000), STORAGE)
    message = refused(path, "norm", "--clip", "1", "--memory", "16M", words="--memory")
    assert "10000" in message or "names" in message


def test_nested_pairs_with_a_big_memo_end_in_the_names_bound(tmp_path):
    # 2 ** 40 names; the 300 000 padding entries made the old walk budget ~13 million nodes
    # (half a minute); the walk now ends within what --memory holds of names
    path = wrap(tmp_path / "pairs.pt", nested_pairs(40, 300_000), STORAGE)
    message = refused(path, "report", "--memory", "16M")
    assert "a pickle bomb" in message or "--memory" in message


def test_many_honest_names_still_read(tmp_path):
    arrays = {f"model.layers.{i}.mlp.down_proj.weight": np.full(2, i, np.float32) for i in range(2000)}
    path = th.save_arrays(tmp_path / "many.pt", arrays)
    result = run("report", "--memory", "16M", path)
    assert result.exit_code == 0, result.output
    tied = wrap(tmp_path / "tied.pt", same_tensor_named(2000), STORAGE)
    result = run("norm", "--clip", "1", "--memory", "16M", tied)
    assert result.exit_code == 0, result.output
    with open_reader(tied) as reader:
        assert len(reader.tensors) == 2000


def test_the_names_bound_follows_the_memory_budget(tmp_path):
    path = wrap(tmp_path / "flat.pt", same_tensor_named(5000), STORAGE)
    with names_within(16 << 20), pytest.raises(UnsupportedError, match="names"):
        load_torch_archive(path)
    with names_within(64 << 20):
        assert len(load_torch_archive(path).tensors) == 5000


# --------------------------------------------------------------------------- item 13: huge strides, far empty views


def test_a_size_one_dimension_of_huge_stride_reads_and_clips(tmp_path):
    storage = np.arange(8, dtype=np.float32)
    path = th.save(tmp_path / "s.pt", {"0": storage}, {"w": th.View("0", 0, (1, 4), (1 << 62, 2)),
                                                          "v": th.View("0", 1, (4, 1), (2, 1 << 62))})
    archive = load_torch_archive(path)
    np.testing.assert_array_equal(read_tensor(archive, "w"), [[0, 2, 4, 6]])
    with open_reader(path) as reader:
        np.testing.assert_array_equal(reader.read("w"), [[0, 2, 4, 6]])
        np.testing.assert_array_equal(reader.read("v"), [[1], [3], [5], [7]])
    out = tmp_path / "out.pt"
    result = run("norm", "--clip", "1", "-o", out, path)
    assert result.exit_code == 0, result.output
    with open_reader(out) as reader:
        w = reader.read("w")
        np.testing.assert_allclose(np.linalg.norm(w), 1, rtol=1e-6)
        np.testing.assert_allclose(w, np.array([[0, 2, 4, 6]]) / np.linalg.norm([0, 2, 4, 6]), rtol=1e-6)
    result = run("report", "--axes", "1", path)
    assert result.exit_code == 0, result.output


def test_an_empty_view_far_past_its_storage_is_an_empty_tensor(tmp_path):
    storage = np.arange(8, dtype=np.float32)
    path = th.save(tmp_path / "e.pt", {"0": storage}, {"e": th.View("0", 1 << 62, (0,), (1,)),
                                                          "f": th.View("0", 1 << 62, (0, 4), (1 << 62, 1)),
                                                          "w": th.contiguous("0", (8,))})
    with open_reader(path) as reader:
        assert reader.read("e").shape == (0,) and reader.read("f").shape == (0, 4)
    out = tmp_path / "out.pt"
    result = run("norm", "--clip", "1", "-o", out, path)
    assert result.exit_code == 0, result.output
    result = run("diff", path, out)  # the empty views equal, w clipped
    assert result.exit_code == 3 and "2 tensor(s) equal" in result.output, result.output
    out = tmp_path / "global.pt"  # every tensor rewritten, the empty ones too
    result = run("global", "--clip", "1", "-o", out, path)
    assert result.exit_code == 0, result.output
    with open_reader(out) as reader:
        np.testing.assert_allclose(reader.read("w"), storage / np.linalg.norm(storage), rtol=1e-6)
        assert reader.read("e").shape == (0,)


# --------------------------------------------------------------------------- item 15: float8_e5m2 views, CRC off


def _torch_file(tmp_path: Path, name: str, make) -> Path:
    torch = pytest.importorskip("torch")
    path = tmp_path / name
    make(torch, path)
    return path


def test_a_strided_float8_e5m2_view_reads_and_clips(tmp_path):
    def make(torch, path):
        x = torch.linspace(-3, 3, 10)
        torch.save({"v": x.to(torch.float8_e5m2)[1::2], "u": x.to(torch.float8_e4m3fn)[1::2]}, path)

    path = _torch_file(tmp_path, "f8.pt", make)
    import torch

    expected = torch.load(path, weights_only=True)["v"].float().numpy().astype(ml_dtypes.float8_e5m2)
    with open_reader(path) as reader:
        np.testing.assert_array_equal(reader.read("v").astype(np.float32), expected.astype(np.float32))
    np.testing.assert_array_equal(read_tensor(load_torch_archive(path), "v").astype(np.float32),
                                  expected.astype(np.float32))
    out = tmp_path / "out.pt"
    result = run("value", "--min", "-1", "--max", "1", "-o", out, path)
    assert result.exit_code == 0, result.output
    with open_reader(out) as reader:
        np.testing.assert_array_equal(reader.read("v").astype(np.float32),
                                      np.clip(expected.astype(np.float32), -1, 1))


def crc_disabled(tmp_path: Path) -> Path:
    def make(torch, path):
        torch.serialization.set_crc32_options(False)
        try:
            torch.save({"w": torch.arange(12.0).reshape(3, 4), "b": torch.ones(4)}, path)
        finally:
            torch.serialization.set_crc32_options(True)

    return _torch_file(tmp_path, "nocrc.pt", make)


def test_a_file_saved_with_crc32_off_is_read_and_clipped(tmp_path):
    path = crc_disabled(tmp_path)
    with zipfile.ZipFile(path) as archive:
        assert {i.CRC for i in archive.infolist()} == {0}
    with open_reader(path) as reader:
        np.testing.assert_array_equal(reader.read("w"), np.arange(12.0, dtype=np.float32).reshape(3, 4))
    out = tmp_path / "out.pt"
    result = run("norm", "--clip", "1", "-o", out, path)
    assert result.exit_code == 0, result.output
    # the output keeps the file's convention (every CRC 0), so it reads again, here and in torch
    with zipfile.ZipFile(out) as archive:
        assert {i.CRC for i in archive.infolist()} == {0}
    with open_reader(out) as reader:
        np.testing.assert_allclose(np.linalg.norm(reader.read("w")), 1, rtol=1e-6)
    import torch

    loaded = torch.load(out, weights_only=True)
    np.testing.assert_allclose(float(loaded["w"].norm()), 1, rtol=1e-6)


def test_a_hand_made_file_with_crc32_off_is_read_and_rewritten(tmp_path):
    path = th.save_arrays(tmp_path / "t.pt", {"w": np.arange(4, dtype=np.float32) * 3}, crc32=False)
    out = tmp_path / "out.pt"
    result = run("norm", "--clip", "1", "-o", out, path)
    assert result.exit_code == 0, result.output
    with zipfile.ZipFile(out) as archive:
        assert {i.CRC for i in archive.infolist()} == {0}
    with open_reader(out) as reader:
        np.testing.assert_allclose(reader.read("w"), np.arange(4) / np.linalg.norm(np.arange(4)), rtol=1e-6)


def test_one_zero_crc_among_real_ones_is_damage(tmp_path):
    path = th.save_arrays(tmp_path / "t.pt", {"w": np.arange(4, dtype=np.float32)})
    raw = bytearray(path.read_bytes())
    entry = central_entry(bytes(raw), "archive/data.pkl")
    struct.pack_into("<L", raw, entry + 16, 0)
    path.write_bytes(bytes(raw))
    refused(path, "report", words="CRC-32")


# --------------------------------------------------------------------------- item 20: truncated files


@pytest.mark.parametrize("fraction", [0.02, 0.3, 0.6, 0.95, 0.999])
def test_a_file_cut_short_says_truncated(tmp_path, fraction):
    arrays = {f"layers.{i}.weight": np.full((8, 8), i, np.float32) for i in range(6)}
    whole = th.save_arrays(tmp_path / "whole.pt", arrays).read_bytes()
    path = tmp_path / "cut" / "t.pt"
    path.parent.mkdir()
    path.write_bytes(whole[:max(60, int(len(whole) * fraction))])
    refused(path, "report", words="truncated")


def test_a_torch_file_cut_short_names_the_size_it_needs(tmp_path):
    path = _torch_file(tmp_path, "t.pt", lambda torch, p: torch.save({"w": torch.ones(1000)}, p))
    whole = path.read_bytes()
    with zipfile.ZipFile(path) as archive:
        info = archive.getinfo("t/data/0")
    cut = tmp_path / "cut" / "t.pt"
    cut.parent.mkdir()
    cut.write_bytes(whole[:info.header_offset + 200])  # inside the storage's data
    message = refused(cut, "info", words="truncated")
    assert "expected" in message


def test_garbage_after_a_local_header_is_not_called_truncated(tmp_path):
    path = tmp_path / "junk.pt"
    path.write_bytes(b"PK\x03\x04" + b"\xff" * 200)
    message = refused(path, "report")
    assert "truncated" not in message
