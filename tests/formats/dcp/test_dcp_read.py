"""PyTorch Distributed Checkpoint (DCP) folders, read without torch and without running pickle.

The folders are written by the real ``torch.distributed.checkpoint`` in a child process
(:mod:`dcp_helpers`): one process with a torchtitan-style state, two ranks on gloo with
``Shard(0)`` (uneven), ``Shard(1)`` and ``Replicate()`` DTensors, the SAFETENSORS variant,
zstd items, and damaged or hostile copies. Every value read must be the one torch loads back.
"""

from __future__ import annotations

import json
import math
import os
import pickle
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import support
from support import torch_helpers as th
from support.cli import run
from support.dcp_helpers import expected, make_all
from tclip.errors import FormatError, UnsupportedError
from tclip.formats import open_reader, registry
from tclip.formats.torch.pickled import TORCH_DTYPES
from tclip.formats.dcp import Reader, sniff
from tclip.formats.dcp._metadata import load_dcp_metadata

WQ = "model.layers.0.attention.wq.weight"   # 7x4 float32 on Shard(0): rows 0-3 and 4-6
W1 = "model.layers.0.feed_forward.w1.weight"  # 257x3 bfloat16 on Shard(0): 129 + 128 rows
WO = "model.layers.0.attention.wo.weight"   # 3x9 float32 on Shard(1): 5 + 4 columns


@pytest.fixture(scope="session")
def dcp_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    pytest.importorskip("torch")
    root = tmp_path_factory.mktemp("dcp")
    make_all(root)
    return root


def values(arrays: dict, meta: dict, name: str) -> np.ndarray:
    info = meta["tensors"][name]
    return arrays[name].view(TORCH_DTYPES[info["dtype"]]).reshape(info["shape"])


def norm(array: np.ndarray) -> float:
    return math.sqrt(float(np.sum(np.square(array.astype(np.float64)))))


# ----------------------------------------------------------------------------- values


@pytest.mark.parametrize("kind", ["single", "ranks2", "safetensors", "zstd"])
def test_every_tensor_is_what_torch_loads_back(dcp_root: Path, kind: str, monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("pickle was called")

    for name in ("load", "loads", "Unpickler"):
        monkeypatch.setattr(pickle, name, refuse)
    folder, arrays, meta = expected(dcp_root, kind)
    with Reader(folder) as reader:
        assert set(reader.tensors) == set(meta["tensors"])
        for name, info in reader.tensors.items():
            want = values(arrays, meta, name)
            assert info.shape == want.shape and info.dtype == want.dtype, name
            assert reader.read(name).tobytes() == want.tobytes(), name
            flat = want.reshape(-1)
            for start in range(0, flat.size, 5):
                stop = min(flat.size, start + 13)
                assert reader.read_flat(name, start, stop).tobytes() == flat[start:stop].tobytes(), (name, start)


def test_a_chunk_saved_as_a_strided_view(dcp_root: Path) -> None:
    folder, arrays, meta = expected(dcp_root, "single")
    with Reader(folder) as reader:
        reader.read("lm_head.transposed")
        piece = reader.pieces["lm_head.transposed"][0]
        assert not piece.dense and piece.stride == (1, 6)
        assert reader.region("lm_head.transposed") is None
        want = values(arrays, meta, "lm_head.transposed")
        assert reader.read("lm_head.transposed", (slice(1, 5), slice(1, 3))).tobytes() == want[1:5, 1:3].tobytes()


def test_blocks_across_chunk_boundaries(dcp_root: Path) -> None:
    folder, arrays, meta = expected(dcp_root, "ranks2")
    with Reader(folder) as reader:
        assert [len(reader.pieces[n]) for n in (WQ, W1, WO)] == [2, 2, 2]
        for name, index in ((WQ, (slice(2, 6), slice(1, 3))), (WO, (slice(1, 3), slice(3, 7))),
                            (W1, (slice(100, 200), slice(0, 3))), (WO, (slice(0, 3), slice(0, 9)))):
            assert reader.read(name, index).tobytes() == values(arrays, meta, name)[index].tobytes(), name
        assert reader.region(WQ) is None  # two chunks: no single run of a file
        assert reader.region("model.norm.weight") is not None  # replicated: stored once, one run
        assert reader.chunk_files(WQ) == ["__0_0.distcp", "__1_0.distcp"]


@pytest.mark.parametrize("kind", ["single", "safetensors", "zstd"])
def test_bytes_items_are_not_tensors_with_plain_values(dcp_root: Path, kind: str) -> None:
    folder, _, meta = expected(dcp_root, kind)
    with Reader(folder) as reader:
        others = {o.name: o.reason for o in reader.others}
    assert set(others) == set(meta["others"])
    assert others["optimizer.param_groups.output.weight.lr"] == "value 0.001"
    assert others["optimizer.param_groups.output.weight.betas"] == "value (0.9, 0.999)"
    assert others["train_state.global_avg_losses"] == "value [0.5, 0.25, 0.125]"
    assert others["lr_scheduler.last_epoch"] == "value 3"


def test_optimizer_moments_are_optimizer_state(dcp_root: Path) -> None:
    folder, _, _ = expected(dcp_root, "single")
    with Reader(folder) as reader:
        marked = {name for name, info in reader.tensors.items() if info.optimizer_state}
    assert marked == {name for name in reader.tensors if name.startswith("optimizer.state.")}
    assert "optimizer.state.layers.1.attention.wq.weight.exp_avg_sq" in marked
    assert "optimizer.state.output.weight.step" in marked
    assert len(marked) == 27


@pytest.mark.parametrize("kind", ["single", "ranks2"])
def test_report_norms_match_torch(dcp_root: Path, kind: str) -> None:
    folder, arrays, meta = expected(dcp_root, kind)
    result = run("report", "--json", folder)
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout.splitlines()[0])
    measured = {t["name"]: t for t in report["tensors"]}
    counted = 0.0
    for name, info in meta["tensors"].items():
        if not info["dtype"].startswith(("float", "bfloat")):
            continue
        want = norm(values(arrays, meta, name))
        assert measured[name]["norm"] == pytest.approx(want, rel=1e-12, abs=0), name
        if not name.startswith("optimizer."):
            counted += want * want
    assert report["global_norm"] == pytest.approx(math.sqrt(counted), rel=1e-12)


def test_info_on_the_folder_and_on_its_metadata(dcp_root: Path) -> None:
    folder, _, _ = expected(dcp_root, "ranks2")
    for target in (folder, folder / ".metadata"):
        result = run("info", target)
        assert result.exit_code == 0, result.output
        assert "dcp" in result.stdout and "257×3" in result.stdout and WO in result.stdout
        assert "step" in result.stdout and "value 11" in result.stdout


def test_detected_by_content(dcp_root: Path) -> None:
    folder, _, _ = expected(dcp_root, "single")
    assert registry.detect_format(folder / ".metadata") == "dcp"
    assert sniff((folder / ".metadata").read_bytes()[:512], 0)
    assert not sniff((folder / "__0_0.distcp").read_bytes()[:512], 0)
    with open_reader(folder / ".metadata") as reader:
        assert reader.format_name == "dcp"


def test_tclip_never_imports_torch(dcp_root: Path) -> None:
    folder, _, _ = expected(dcp_root, "ranks2")
    script = ("import sys\nfrom tclip.cli import cli\n"
              f"cli.main(['report', {str(folder)!r}], standalone_mode=False)\n"
              "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.')))\n")
    env = {**os.environ, "PYTHONPATH": str(support.ROOT / "src")}
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().splitlines()[-1] == "[]"


def test_zstd_without_the_package_names_it(dcp_root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    folder, _, _ = expected(dcp_root, "zstd")
    monkeypatch.setitem(sys.modules, "zstandard", None)
    with Reader(folder) as reader:
        assert {o.reason for o in reader.others} == {"not a tensor; kept as it is"}  # listed, values unread
        with pytest.raises(UnsupportedError, match="'zstandard'"):
            reader.read("output.weight")
    result = run("report", folder)
    assert result.exit_code == 1
    assert "install the 'zstandard' package" in result.stderr


# ----------------------------------------------------------------------------- broken and hostile folders

BROKEN = {
    "overlap": "the chunks of 'model.layers.0.attention.wq.weight' (shape [7, 4]) overlap",
    "gap": "leave part of it unwritten",
    "missing_file": "__9_0.distcp: no such file",
    "escape": "names the file '../outside.distcp', which is not inside the folder",
    "absolute": "which is not inside the folder",
    "past_end": "the item 'model.scale' at bytes 8337...10014 runs past the end of the file",
    "truncated": "__1_0.distcp: the item 'model.layers.0.feed_forward.w1.weight' at bytes",
    "bytes_overlap": "__1_0.distcp: the items 'model.layers.0.attention.wq.weight' and 'step' overlap",
    "hostile_chunk": "refused global 'posix.system'",
    "hostile_metadata": ".metadata: refused global 'posix.system'",
}


# what a chunk's own zip holds is read (and checked) when its tensor is read: info lists these
READ_WITH_THE_DATA = {"hostile_chunk"}


@pytest.mark.parametrize("case", sorted(BROKEN))
@pytest.mark.parametrize("command", ["info", "report"])
def test_broken_folder_is_one_error_line(dcp_root: Path, case: str, command: str) -> None:
    folder = dcp_root / "broken" / case
    if command == "info" and case in READ_WITH_THE_DATA:
        assert run(command, folder).exit_code == 0
        assert not (folder / "PWNED").exists()
        return
    result = run(command, folder)
    assert result.exit_code == 1, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"Error: {folder}: "), result.stderr
    assert BROKEN[case] in lines[0]
    if case == "hostile_chunk":  # the chunk is named, whatever the .pt reader calls what it refused
        assert "__1_0.distcp: the item 'model.scale' at byte 9914: " in lines[0]
    assert "state_dict" not in lines[0]  # the .pt reader's advice is no help here
    assert "Traceback" not in result.output
    assert not (folder / "PWNED").exists()


def test_hostile_bytes_item_is_listed_never_run(dcp_root: Path) -> None:
    folder = dcp_root / "broken" / "hostile_bytes_item"
    result = run("info", folder)
    assert result.exit_code == 0, result.output
    with Reader(folder) as reader:
        assert [(o.name, o.reason) for o in reader.others] == [("step", "not a tensor; kept as it is")]
    assert not (folder / "PWNED").exists()


# ----------------------------------------------------------------------------- hand-made .metadata pickles

META = "torch.distributed.checkpoint.metadata"


def record(cls: str, state: bytes, module: str = META) -> bytes:
    return th.glob(module, cls) + b")\x81" + state + b"b"


def props() -> bytes:
    return record("TensorProperties", th.tup(th.glob("torch", "float32"), th.text("torch.strided"), b"\x89",
                                             th.num(0), b"\x89"))


def metadata(entries: bytes, storage: bytes = b"}") -> bytes:
    return b"\x80\x02" + record("Metadata", th.mapping([("state_dict_metadata", entries),
                                                        ("storage_data", storage)])) + b"."


@pytest.mark.parametrize("payload, refused", [
    (th.glob("os", "system") + th.tup(th.text("true")) + b"R", "refused global 'os.system'"),
    (th.glob("builtins", "eval") + th.tup(th.text("1")) + b"R", "refused global 'builtins.eval'"),
    (th.glob("__main__", "Payload") + b")\x81", "refused global '__main__.Payload'"),
    (th.glob("torch", "Size") + b")\x81", "pickles an object of class torch.Size (opcode NEWOBJ)"),
    (th.glob("torch.distributed.checkpoint.filesystem", "FileSystemReader") + b")\x81", "refused global"),
])
def test_metadata_refuses_every_other_global(payload: bytes, refused: str) -> None:
    data = metadata(b"}(" + th.text("w") + payload + b"u")
    with pytest.raises(UnsupportedError, match=refused.replace("(", r"\(").replace(")", r"\)")):
        load_dcp_metadata(data, path="ckpt")


def test_metadata_refuses_a_second_build() -> None:
    chunk = record("ChunkStorageMetadata", th.mapping([("offsets", th.tup(th.num(0))), ("sizes", th.tup(th.num(1)))]))
    twice = chunk + th.mapping([("offsets", th.tup(th.num(5)))]) + b"b"
    entry = record("TensorStorageMetadata", th.mapping([("properties", props()), ("size", th.tup(th.num(1))),
                                                        ("chunks", b"](" + twice + b"e")]))
    with pytest.raises(FormatError, match="BUILD on a ChunkStorageMetadata twice"):
        load_dcp_metadata(metadata(b"}(" + th.text("w") + entry + b"u"))


def test_metadata_shared_chunk_lists_are_read_once() -> None:
    """One list of 1000 chunks, memoized and given to 5000 tensors: a small pickle whose records
    expand to five million chunks. Each list is read once (the tensors share the result)."""
    chunks = b"".join(record("ChunkStorageMetadata", th.mapping([("offsets", th.tup(th.num(i))),
                                                                 ("sizes", th.tup(th.num(1)))]))
                      for i in range(1000))
    shared = b"](" + chunks + b"e" + b"r\x00\x00\x00\x00"  # LONG_BINPUT 0

    def entry(chunk_list: bytes) -> bytes:
        return record("TensorStorageMetadata", th.mapping([("properties", props()), ("size", th.tup(th.num(1000))),
                                                           ("chunks", chunk_list)]))

    entries = th.text("w0") + entry(shared) + b"".join(th.text(f"w{i}") + entry(b"j\x00\x00\x00\x00")
                                                        for i in range(1, 5000))
    data = metadata(b"}(" + entries + b"u")
    assert len(data) < 2_000_000
    meta = load_dcp_metadata(data)
    assert len(meta.entries) == 5000 and len(meta.entries["w0"].chunks) == 1000
    assert all(entry.chunks is meta.entries["w0"].chunks for entry in meta.entries.values())


def test_metadata_work_is_bounded_by_its_size() -> None:
    """30000 chunks of 17 bytes each, every one made of memo references to one tuple of 60
    offsets: more integers to check than the file's size allows. Refused."""
    dims = th.tup(*[th.num(0)] * 60) + b"q\x01"
    first = (th.glob(META, "ChunkStorageMetadata") + b"q\x02)\x81}(" + th.text("offsets") + b"q\x03h\x01"
             + th.text("sizes") + b"q\x04h\x01ub")
    more = b"h\x02)\x81}(h\x03h\x01h\x04h\x01ub"
    entry = record("TensorStorageMetadata", th.mapping([("properties", props()), ("size", dims),
                                                        ("chunks", b"](" + first + more * 30_000 + b"e")]))
    with pytest.raises(UnsupportedError, match="pickle bomb"):
        load_dcp_metadata(metadata(b"}(" + th.text("w") + entry + b"u"))


def test_metadata_hand_made_reads_as_plain_data() -> None:
    chunk = record("ChunkStorageMetadata", th.mapping([("offsets", th.glob("torch", "Size") + th.tup(th.tup(th.num(0)))
                                                        + b"R"), ("sizes", th.tup(th.num(3)))]))
    entry = record("TensorStorageMetadata", th.mapping([("properties", props()), ("size", th.tup(th.num(3))),
                                                        ("chunks", b"](" + chunk + b"e")]))
    key = record("MetadataIndex", th.mapping([("fqn", th.text("w")), ("offset", th.tup(th.num(0))),
                                              ("index", th.num(0))]))
    info = record("_StorageInfo", th.mapping([("relative_path", th.text("__0_0.distcp")), ("offset", th.num(0)),
                                              ("length", th.num(9))]),
                  module="torch.distributed.checkpoint.filesystem")
    meta = load_dcp_metadata(metadata(b"}(" + th.text("w") + entry + b"u", b"}(" + key + info + b"u"))
    assert meta.entries["w"].dtype == "float32" and meta.entries["w"].shape == (3,)
    assert meta.entries["w"].chunks[0].offsets == (0,) and meta.entries["w"].chunks[0].sizes == (3,)
    assert [(i.fqn, i.index, i.relative_path, i.offset, i.length) for i in meta.items] == \
        [("w", 0, "__0_0.distcp", 0, 9)]


# ----------------------------------------------------------------------------- damaged bytes


def test_zstd_item_decompressing_past_its_chunk_is_refused(dcp_root: Path, tmp_path: Path) -> None:
    """A zstd frame of 16 MiB of zeros, written over the item of a 16x16 bf16 chunk (512 bytes):
    decompression stops past what the chunk can hold."""
    zstandard = pytest.importorskip("zstandard")
    folder = tmp_path / "bomb"
    import shutil

    shutil.copytree(expected(dcp_root, "zstd")[0], folder)
    with Reader(folder) as reader:
        item = reader.pieces["layers.0.attention.wq.weight"][0].item
    frame = zstandard.ZstdCompressor(level=19).compress(bytes(16 << 20))
    assert len(frame) <= item.length
    with open(folder / item.relative_path, "r+b") as handle:
        handle.seek(item.offset)
        handle.write(frame)
    with Reader(folder) as reader, pytest.raises(FormatError, match="decompresses to more than"):
        reader.read("layers.0.attention.wq.weight")
    result = run("report", folder)
    assert result.exit_code == 1 and "decompresses to more than" in result.stderr


@pytest.mark.parametrize("kind", ["ranks2", "safetensors", "zstd"])
def test_damaged_bytes_give_tclip_errors_only(dcp_root: Path, tmp_path: Path, kind: str) -> None:
    """Random byte changes and truncations of the .metadata or a .distcp: reading either works
    or raises tclip's own error (one line at the command line), never anything else."""
    import random
    import shutil

    from tclip.errors import TclipError

    source = expected(dcp_root, kind)[0]
    rng = random.Random(20261128)
    for trial in range(40):
        folder = tmp_path / f"t{trial}"
        shutil.copytree(source, folder)
        target = rng.choice([folder / ".metadata", *sorted(folder.glob("*.distcp"))])
        data = bytearray(target.read_bytes())
        for _ in range(rng.randint(1, 4)):
            data[rng.randrange(len(data))] = rng.randrange(256)
        if rng.random() < 0.2:
            data = data[:rng.randrange(len(data))]
        target.write_bytes(bytes(data))
        try:
            with Reader(folder) as reader:
                for name, info in reader.tensors.items():
                    if not info.refused:
                        reader.read(name)
        except TclipError:
            pass
        shutil.rmtree(folder)


def test_summary_over_step_folders(dcp_root: Path, tmp_path: Path) -> None:
    import shutil

    for step, kind in (("step-100", "zstd"), ("step-200", "safetensors")):
        shutil.copytree(expected(dcp_root, kind)[0], tmp_path / "checkpoint" / step)
    result = run("report", "--summary", "--json", str(tmp_path / "checkpoint" / "step-*"))
    assert result.exit_code == 0, result.output
    files = [json.loads(line) for line in result.stdout.splitlines() if line.strip()]
    assert [Path(f["file"]).name for f in files] == ["step-100", "step-200"]
    assert files[0]["global_norm"] == pytest.approx(files[1]["global_norm"], rel=1e-12)  # the same state saved twice


def test_diff_of_two_folders_compares_tensors_and_plain_items(dcp_root: Path, tmp_path: Path) -> None:
    import shutil

    folder = expected(dcp_root, "ranks2")[0]
    shutil.copytree(folder, tmp_path / "copy")
    result = run("diff", folder, tmp_path / "copy")
    assert result.exit_code == 0, result.output
    assert "not numbers, compared exactly: step" in result.stdout


def test_a_link_leading_out_of_the_folder_is_refused(dcp_root: Path, tmp_path: Path) -> None:
    import shutil

    folder = tmp_path / "linked"
    shutil.copytree(expected(dcp_root, "ranks2")[0], folder)
    shutil.move(folder / "__1_0.distcp", tmp_path / "elsewhere.distcp")
    (folder / "__1_0.distcp").symlink_to(tmp_path / "elsewhere.distcp")
    result = run("info", folder)
    assert result.exit_code == 1
    assert result.stderr.strip() == (f"Error: {folder}: .metadata names the file '__1_0.distcp', which leads out of "
                                     "the folder")


@pytest.mark.parametrize("kind", ["ranks2", "zstd"])
def test_written_to_safetensors_bit_for_bit(dcp_root: Path, tmp_path: Path, kind: str) -> None:
    """A value clip that changes nothing, from a DCP folder into one safetensors file: every
    tensor is what torch loads back (the items that are not tensors dropped, as asked)."""
    folder, arrays, meta = expected(dcp_root, kind)
    out = tmp_path / "out.safetensors"
    result = run("value", "--min", -1e30, "--max", 1e30, folder / ".metadata", "-o", out, "--drop-nonnumeric")
    assert result.exit_code == 0, result.output
    with open_reader(out) as reader:
        assert set(reader.tensors) == set(meta["tensors"])
        for name in reader.tensors:
            assert reader.read(name).tobytes() == values(arrays, meta, name).tobytes(), name


def test_a_fifo_for_metadata_is_refused_without_waiting(tmp_path: Path) -> None:
    (tmp_path / "__0_0.distcp").write_bytes(b"")
    os.mkfifo(tmp_path / ".metadata")
    with pytest.raises(FormatError, match=r"\.metadata is not a regular file"):
        Reader(tmp_path)


def test_megatron_metadata_class_is_read_as_metadata() -> None:
    data = (b"\x80\x04" + record("MCoreMetadata", th.mapping([("state_dict_metadata", b"}"), ("storage_data", b"}")]),
                                 module="megatron.core.dist_checkpointing.strategies.torch") + b".")
    assert load_dcp_metadata(data).entries == {}
    framed = (b"\x80\x04\x95" + bytes(8) + b"\x8c\x31megatron.core.dist_checkpointing.strategies.torch\x94"
              b"\x8c\x0dMCoreMetadata\x94\x93\x94)\x81")
    assert sniff(framed, 1000)
    assert not sniff(framed.replace(b"MCoreMetadata", b"MCoreSavePlan"), 1000)


def test_coverage_checks_within_their_budget() -> None:
    from tclip.formats.dcp._metadata import Chunk
    from tclip.formats.dcp.reader import _coverage

    shards = [Chunk((0, 0), (4, 4)), Chunk((4, 0), (3, 4))]
    assert _coverage((7, 4), shards, [10]) is None
    assert _coverage((7, 4), [Chunk((0, 0), (4, 4)), Chunk((3, 0), (3, 4))], [10]) == "overlap"
    budget = [2]  # the grid of two row shards has 2 cells: spent
    assert _coverage((7, 4), shards, budget) is None and budget == [0]
    # three chunks on a 3x3 tensor: a grid of 4 cells, or 3 pairs
    stairs = [Chunk((0, 0), (1, 3)), Chunk((1, 0), (2, 1)), Chunk((1, 1), (2, 2))]
    budget = [4]
    assert _coverage((3, 3), stairs, budget) is None and budget == [0]  # on the grid
    budget = [3]
    assert _coverage((3, 3), stairs, budget) is None and budget == [0]  # pair by pair
    assert "too irregular" in _coverage((3, 3), stairs, [2])


@pytest.mark.parametrize("recursive", [False, True])
def test_a_folder_of_step_folders(dcp_root: Path, tmp_path: Path, recursive: bool) -> None:
    import shutil

    for step, kind in (("step-100", "zstd"), ("step-200", "safetensors")):
        shutil.copytree(expected(dcp_root, kind)[0], tmp_path / "checkpoint" / step)
    result = run("report", "--summary", "--json", *(["-r"] if recursive else []), tmp_path / "checkpoint")
    assert result.exit_code == 0, result.output
    files = [json.loads(line) for line in result.stdout.splitlines() if line.strip()]
    assert [Path(f["file"]).name for f in files] == ["step-100", "step-200"]
