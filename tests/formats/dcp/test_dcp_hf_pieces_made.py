"""DCP Hugging Face piece folders made here byte by byte (no torch): any grid of pieces over any
files and ranks reads back as the whole array, blocks included; damaged headers end in a tclip
error and nothing else. (The folders torch writes are tested in test_dcp_hf_shards.py.)"""

from __future__ import annotations

import json
import random
import struct
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tclip.errors import TclipError
from tclip.formats.dcp.hf_shards import HfShardsReader
from tclip.formats.dcp.per_rank import fold_pieces

CODES = {np.dtype("<f4"): "F32", np.dtype("<f8"): "F64", np.dtype("<i2"): "I16"}


def write_piece(path: Path, pieces: dict[str, tuple[np.ndarray, tuple[int, ...]]]) -> None:
    """A safetensors file of ``pieces`` (name -> (values, saved_offsets)), as torch's writer lays it out."""
    header: dict = {"__metadata__": {"DCP_SHARDING_INFO": json.dumps(
        {name: {"saved_offsets": list(offsets)} for name, (_, offsets) in pieces.items()}), "format": "pt"}}
    data, position = b"", 0
    for name, (array, _) in pieces.items():
        raw = array.tobytes()  # (C order)
        header[name] = {"dtype": CODES[array.dtype], "shape": list(array.shape),
                        "data_offsets": [position, position + len(raw)]}
        data += raw
        position += len(raw)
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    path.write_bytes(struct.pack("<Q", len(text)) + text + data)


def cuts(rng: random.Random, n: int) -> list[int]:
    inner = sorted(rng.sample(range(1, n), min(n - 1, rng.randint(0, 3)))) if n > 1 else []
    return [0, *inner, n]


def make_folder(folder: Path, arrays: dict[str, np.ndarray], seed: int) -> None:
    """Each array cut into a grid of pieces (an empty piece here and there, as DTensor gives a rank
    with no rows), each piece on its own rank, shuffled, in one file of the tensor's (as
    ``fqn_to_index_mapping`` puts it)."""
    rng = random.Random(seed)
    files = rng.randint(1, 3)
    content: dict[tuple[int, int], dict] = {}
    for name, array in arrays.items():
        grid = [cuts(rng, n) for n in array.shape]
        boxes = []
        for index in np.ndindex(*[len(c) - 1 for c in grid]):  # (a 0-d array: one empty box)
            boxes.append(tuple((grid[a][i], grid[a][i + 1]) for a, i in enumerate(index)))
        if array.shape and rng.random() < 0.3:  # an empty piece at the end of axis 0
            boxes.append(((array.shape[0], array.shape[0]), *((0, n) for n in array.shape[1:])))
        rng.shuffle(boxes)
        file = rng.randint(1, files)
        for rank, box in enumerate(boxes, start=1):
            part = array[tuple(slice(lo, hi) for lo, hi in box)] if box else array
            content.setdefault((rank, file), {})[name] = (part, tuple(lo for lo, _ in box))
    count = max(file for _, file in content)
    for (rank, file), pieces in content.items():
        write_piece(folder / f"shard-{rank:05d}-model-{file:05d}-of-{count:05d}.safetensors", pieces)


shapes = st.lists(st.integers(1, 7), min_size=0, max_size=3).map(tuple)


@settings(max_examples=60)
@given(st.lists(shapes, min_size=1, max_size=3), st.integers(0, 10**6),
       st.sampled_from(sorted(CODES, key=str)))
def test_any_grid_of_pieces_reads_back_whole(tmp_path_factory: pytest.TempPathFactory, sizes: list,
                                             seed: int, dtype: np.dtype) -> None:
    folder = tmp_path_factory.mktemp("pieces")
    rng = np.random.default_rng(seed)
    arrays = {f"model.layers.{i}.mlp.down_proj.weight": (rng.standard_normal(shape) * 100).astype(dtype)
              for i, shape in enumerate(sizes)}
    make_folder(folder, arrays, seed)
    with HfShardsReader(folder) as reader:
        assert set(reader.tensors) == set(arrays)
        for name, want in arrays.items():
            assert reader.tensors[name].shape == want.shape and reader.tensors[name].dtype == want.dtype
            assert reader.read(name).tobytes() == want.tobytes(), name
            if want.ndim:
                block = tuple(slice(n // 3, max(n // 3 + 1, n - 1)) for n in want.shape)
                assert reader.read(name, block).tobytes() == want[block].tobytes(), name
            flat = want.reshape(-1)
            assert reader.read_flat(name, flat.size // 2, flat.size).tobytes() == flat[flat.size // 2:].tobytes()


@settings(max_examples=80)
@given(st.integers(0, 10**6), st.lists(st.tuples(st.integers(0, 10**6), st.integers(0, 255)), min_size=1,
                                        max_size=4))
def test_damaged_headers_end_in_a_tclip_error(tmp_path_factory: pytest.TempPathFactory, seed: int,
                                              flips: list) -> None:
    folder = tmp_path_factory.mktemp("damaged")
    rng = np.random.default_rng(seed)
    make_folder(folder, {"a.weight": rng.standard_normal((5, 4)).astype("<f4"),
                         "b.bias": rng.standard_normal(6).astype("<f4")}, seed)
    files = sorted(folder.iterdir())
    target = files[seed % len(files)]
    raw = bytearray(target.read_bytes())
    (length,) = struct.unpack("<Q", raw[:8])
    for where, value in flips:
        raw[8 + where % length] = value
    target.write_bytes(bytes(raw))
    try:
        with HfShardsReader(folder) as reader:
            for name in reader.tensors:
                reader.read(name)
    except TclipError as error:
        assert str(folder) in str(error.path)


def test_a_folder_of_more_files_than_are_kept_open(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from tclip.formats.dcp import hf_shards

    arrays = {"model.embed_tokens.weight": np.arange(7 * 5, dtype="<f4").reshape(7, 5),
              "model.norm.weight": np.arange(6, dtype="<f8")}
    make_folder(tmp_path, arrays, 11)
    assert len(list(tmp_path.iterdir())) > 2
    monkeypatch.setattr(hf_shards, "MAX_OPEN_FILES", 2)
    with HfShardsReader(tmp_path) as reader:
        assert all(piece.fd == -1 for pieces in reader.pieces.values() for piece in pieces)
        assert all(reader.region(name) is None for name in arrays)
        for name, want in arrays.items():
            assert reader.read(name).tobytes() == want.tobytes(), name
            assert reader.read(name, (slice(1, 4),) * want.ndim).tobytes() == want[(slice(1, 4),) * want.ndim].tobytes()
        victim = sorted(tmp_path.iterdir())[0]
        victim.write_bytes(victim.read_bytes() + b"x")
        with pytest.raises(TclipError, match="changed since the folder was opened"):
            for name in arrays:
                reader.read(name)


def test_fold_pieces_takes_a_folder_only_when_every_piece_is_there(tmp_path: Path) -> None:
    make_folder(tmp_path, {"w": np.arange(12, dtype="<f4").reshape(3, 4)}, 7)
    pieces = sorted(tmp_path.iterdir())
    other = tmp_path.parent / "model.safetensors"
    assert fold_pieces([other, *pieces]) == [other, tmp_path]
    if len(pieces) > 1:
        assert fold_pieces(pieces[1:]) == pieces[1:]


def test_a_renamed_piece_is_known_by_its_offsets(tmp_path: Path) -> None:
    """A piece placed off the origin is refused alone whatever its name; one whose every offset is
    zero under another name (what the writer saves from one rank's full state dict) is read."""
    from tclip.errors import UnsupportedError
    from tclip.formats import open_reader

    rows = np.arange(8, dtype="<f4").reshape(2, 4)
    write_piece(tmp_path / "model.safetensors", {"w": (rows, (2, 0)), "b": (rows[0], (0,))})
    with pytest.raises(UnsupportedError, match=r"one rank's pieces of a DCP checkpoint .* give the folder"):
        open_reader(tmp_path / "model.safetensors")
    write_piece(tmp_path / "model.safetensors", {"w": (rows, (0, 0)), "b": (rows[0], (0,))})
    with open_reader(tmp_path / "model.safetensors") as reader:
        assert reader.read("w").tobytes() == rows.tobytes()
