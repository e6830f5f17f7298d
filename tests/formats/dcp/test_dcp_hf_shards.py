"""DCP's Hugging Face storage saved per rank (``HuggingFaceStorageWriter(save_distributed=True)``,
no consolidation): a folder of ``shard-0000R-model-0000F-of-0000N.safetensors`` pieces read as one
set of whole tensors, assembled by each piece's ``saved_offsets``.

The folders are written by the real ``torch.distributed.checkpoint`` in a child process
(:mod:`dcp_hf_helpers`, the ``hf_root`` fixture of this folder's conftest): two gloo ranks with
``Shard(0)`` (uneven), ``Shard(1)``, ``Replicate()`` DTensors and a 0-d tensor, and one process.
Values must be the ones torch's ``HuggingFaceStorageReader`` loads back; damaged copies are made
here by rewriting the pieces' safetensors headers.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import struct
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import support
from support.cli import run
from support.dcp_hf_helpers import NORM, SCALE, W1, WO, WQ
from support.dcp_helpers import expected
from tclip.errors import UnsupportedError
from tclip.formats import open_reader, registry
from tclip.formats.torch.pickled import TORCH_DTYPES

RANK1_A = "shard-00001-model-00001-of-00002.safetensors"  # WQ rows 0-3, WO columns 0-4
RANK2_A = "shard-00002-model-00001-of-00002.safetensors"  # WQ rows 4-6, WO columns 5-8, SCALE
RANK2_B = "shard-00002-model-00002-of-00002.safetensors"  # W1 rows 129-256, NORM


def values(arrays: dict, meta: dict, name: str) -> np.ndarray:
    info = meta["tensors"][name]
    return arrays[name].view(TORCH_DTYPES[info["dtype"]]).reshape(info["shape"])


def loaded(hf_root: Path) -> tuple[dict, dict]:
    """What torch's HuggingFaceStorageReader loads back into the full tensors."""
    _, arrays, meta = expected(hf_root / "hf_ranks2", "loaded")
    return arrays, meta


def norm(array: np.ndarray) -> float:
    return math.sqrt(float(np.sum(np.square(array.astype(np.float64)))))


# ----------------------------------------------------------------------------- values


def test_every_tensor_is_what_torch_loads_back(hf_root: Path) -> None:
    folder = hf_root / "hf_ranks2" / "ckpt"
    arrays, meta = loaded(hf_root)
    assert registry.detect_format(folder) == "dcp"
    with open_reader(folder) as reader:
        assert set(reader.tensors) == set(meta["tensors"]) == {WQ, W1, WO, NORM, SCALE}
        for name, info in reader.tensors.items():
            want = values(arrays, meta, name)
            assert info.shape == want.shape and info.dtype == want.dtype, name
            assert reader.read(name).tobytes() == want.tobytes(), name
            flat = want.reshape(-1)
            for start in range(0, flat.size, 5):
                stop = min(flat.size, start + 13)
                assert reader.read_flat(name, start, stop).tobytes() == flat[start:stop].tobytes(), (name, start)


def test_blocks_read_only_the_pieces_they_meet(hf_root: Path) -> None:
    folder = hf_root / "hf_ranks2" / "ckpt"
    arrays, meta = loaded(hf_root)
    with open_reader(folder) as reader:
        assert reader.chunk_files(WQ) == [RANK1_A, RANK2_A]
        assert reader.chunk_files(NORM) == [RANK2_B]  # replicated: saved once
        for name, index in ((WQ, (slice(2, 6), slice(1, 3))), (WO, (slice(1, 3), slice(3, 7))),
                            (W1, (slice(100, 200), slice(0, 3))), (WO, (slice(0, 3), slice(0, 9)))):
            assert reader.read(name, index).tobytes() == values(arrays, meta, name)[index].tobytes(), name
        assert reader.region(WQ) is None and reader.region(NORM) is not None
        # a block inside rank 2's rows never opens rank 1's piece
        reader.files[0].close()
        assert reader.read(WQ, (slice(4, 7), slice(0, 4))).tobytes() == values(arrays, meta, WQ)[4:].tobytes()


def test_what_torch_consolidates(hf_root: Path) -> None:
    """Bit for bit what ``consolidate_safetensors_files`` writes, but a 0-d tensor: torch 2.13's
    consolidation writes it as 0.0 whatever was saved (the 2.5 here is what torch loads back)."""
    folder = hf_root / "hf_ranks2" / "ckpt"
    consolidated = hf_root / "hf_ranks2" / "consolidated" / "model-00001-of-00001.safetensors"
    with open_reader(folder) as reader, open_reader(consolidated) as whole:
        for name in (WQ, W1, WO, NORM):
            assert reader.read(name).tobytes() == whole.read(name).tobytes(), name
        assert float(reader.read(SCALE)) == 2.5


def test_single_process_folder(hf_root: Path) -> None:
    folder, arrays, meta = expected(hf_root, "hf_single")
    assert [p.name for p in folder.iterdir()] == ["shard-00001-model-00001-of-00001.safetensors"]
    with open_reader(folder) as reader:
        assert set(reader.tensors) == set(meta["tensors"])
        for name in reader.tensors:
            assert reader.read(name).tobytes() == values(arrays, meta, name).tobytes(), name
            assert reader.region(name) is not None  # one piece: one run of one file


def test_report_norms_match_numpy(hf_root: Path) -> None:
    folder = hf_root / "hf_ranks2" / "ckpt"
    arrays, meta = loaded(hf_root)
    result = run("report", "--json", folder)
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout.splitlines()[0])
    measured = {t["name"]: t for t in report["tensors"]}
    assert {n: measured[n]["shape"] for n in measured} == {n: meta["tensors"][n]["shape"] for n in meta["tensors"]}
    total = 0.0
    for name in meta["tensors"]:
        want = norm(values(arrays, meta, name))
        assert measured[name]["norm"] == pytest.approx(want, rel=1e-12, abs=0), name
        total += want * want
    assert report["global_norm"] == pytest.approx(math.sqrt(total), rel=1e-12)


def test_info_lists_the_whole_tensors(hf_root: Path) -> None:
    folder = hf_root / "hf_ranks2" / "ckpt"
    result = run("info", folder)
    assert result.exit_code == 0, result.output
    assert "(dcp," in result.stdout and "257×3" in result.stdout and "7×4" in result.stdout
    assert "3×9" in result.stdout and "5 tensors, 842 parameters" in result.stdout
    assert "129×3" not in result.stdout and "128×3" not in result.stdout


def test_diff_against_the_consolidated_set(hf_root: Path) -> None:
    folder = hf_root / "hf_ranks2" / "ckpt"
    result = run("diff", folder, hf_root / "hf_ranks2" / "consolidated", "--exclude", SCALE)
    assert result.exit_code == 0, result.output
    assert "4 tensor(s) equal (exact)" in result.stdout and "same" in result.stdout.lower()


def test_convert_to_safetensors_then_diff_says_same(hf_root: Path, tmp_path: Path) -> None:
    folder = hf_root / "hf_ranks2" / "ckpt"
    arrays, meta = loaded(hf_root)
    for target in (tmp_path / "out.safetensors", tmp_path / "hf"):
        result = run("convert", folder, target)
        assert result.exit_code == 0, result.output
        assert "not copied" not in result.output  # the pieces are the checkpoint, not side files
        assert target.suffix or sorted(p.name for p in target.iterdir()) == ["model.safetensors"]
        with open_reader(target if target.suffix else target / "model.safetensors") as reader:
            assert set(reader.tensors) == set(meta["tensors"])
            for name in reader.tensors:
                assert reader.read(name).tobytes() == values(arrays, meta, name).tobytes(), name
        result = run("diff", folder, target)
        assert result.exit_code == 0, result.output
        assert "5 tensor(s) equal (exact)" in result.stdout


def test_a_glob_of_every_piece_is_the_folder(hf_root: Path) -> None:
    folder = hf_root / "hf_ranks2" / "ckpt"
    whole = run("report", "--json", folder)
    globbed = run("report", "--json", str(folder / "*.safetensors"))
    assert whole.exit_code == globbed.exit_code == 0, globbed.output
    first, second = (json.loads(r.stdout.splitlines()[0]) for r in (whole, globbed))
    assert second["global_norm"] == first["global_norm"]
    assert {t["name"]: t["shape"] for t in second["tensors"]} == {t["name"]: t["shape"] for t in first["tensors"]}


def test_a_folder_of_step_folders(hf_root: Path, tmp_path: Path) -> None:
    for step in ("step-1", "step-2"):
        shutil.copytree(hf_root / "hf_ranks2" / "ckpt", tmp_path / step)
    result = run("report", "--summary", "--json", tmp_path)
    assert result.exit_code == 0, result.output
    files = [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]
    named = [f for f in files if "file" in f]
    assert [Path(f["file"]).name for f in named] == ["step-1", "step-2"]
    assert named[0]["global_norm"] == named[1]["global_norm"]


def test_the_folder_in_an_across_files_set(hf_root: Path, tmp_path: Path) -> None:
    """The folder is one member of a set given to --across-files: its whole tensors count once."""
    folder = hf_root / "hf_ranks2" / "ckpt"
    arrays, meta = loaded(hf_root)
    head = np.arange(6, dtype=np.float32).reshape(2, 3)
    np.savez(tmp_path / "head.npz", **{"lm_head.weight": head})
    result = run("report", "--json", "--across-files", folder, tmp_path / "head.npz")
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout.splitlines()[0])
    assert len(report["tensors"]) == 6
    total = sum(norm(values(arrays, meta, name)) ** 2 for name in meta["tensors"]) + norm(head) ** 2
    assert report["global_norm"] == pytest.approx(math.sqrt(total), rel=1e-12)


@pytest.mark.parametrize("how", ["alone", "some_pieces", "across_files"])
def test_pieces_named_apart_from_their_folder_are_refused(hf_root: Path, how: str) -> None:
    """A piece's shapes are not its tensors': counted as tensors of their own they would give a
    wrong norm. Each is refused with a line naming the folder to give instead."""
    folder = hf_root / "hf_ranks2" / "ckpt"
    args: tuple[Any, ...] = {
        "alone": (folder / RANK2_A,),
        "some_pieces": (str(folder / "shard-00002-*.safetensors"),),
        "across_files": ("--across-files", folder / RANK1_A, folder / RANK2_B),
    }[how]
    result = run("report", *args)
    assert result.exit_code == 1, result.output
    assert "one rank's pieces of a DCP checkpoint" in result.stderr
    assert f"give the folder ({folder})" in result.stderr
    assert "Traceback" not in result.output and "global norm" not in result.stdout
    with pytest.raises(UnsupportedError, match="give the folder"):
        open_reader(folder / RANK1_A)


def test_a_whole_file_the_writer_saved_from_one_rank_is_read(hf_root: Path, tmp_path: Path) -> None:
    """``save_distributed=False`` writes ``model-0000F-of-0000N.safetensors`` with every offset zero:
    whole tensors, read as the file they are."""
    source = hf_root / "hf_single" / "ckpt" / "shard-00001-model-00001-of-00001.safetensors"
    target = tmp_path / "model-00001-of-00001.safetensors"
    shutil.copy(source, target)
    with open_reader(target) as reader:
        assert reader.tensors[W1].shape == (257, 3)


def test_tclip_never_imports_torch(hf_root: Path) -> None:
    folder = hf_root / "hf_ranks2" / "ckpt"
    script = ("import sys\nfrom tclip.cli import cli\n"
              f"cli.main(['report', {str(folder)!r}], standalone_mode=False)\n"
              "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.')))\n")
    env = {**os.environ, "PYTHONPATH": str(support.ROOT / "src")}
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().splitlines()[-1] == "[]"


# ----------------------------------------------------------------------------- damaged and hostile folders


def rewrite(path: Path, change: Callable[[dict, dict], None]) -> None:
    """Rewrite a piece's safetensors header: ``change(header, sharding)`` edits the header and the
    parsed ``DCP_SHARDING_INFO`` (set back as JSON unless the change put a string there)."""
    raw = path.read_bytes()
    (length,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + length])
    sharding = json.loads(header["__metadata__"]["DCP_SHARDING_INFO"])  # (before the change)
    change(header, sharding)
    meta = header["__metadata__"]
    if meta.pop("keep", None) is None and "DCP_SHARDING_INFO" in meta:
        meta["DCP_SHARDING_INFO"] = json.dumps(sharding)
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    path.write_bytes(struct.pack("<Q", len(text)) + text + raw[8 + length:])


def offsets(name: str, value: Any) -> Callable[[dict, dict], None]:
    def change(header: dict, sharding: dict) -> None:
        sharding[name]["saved_offsets"] = value
    return change


def raw_info(text: Any) -> Callable[[dict, dict], None]:
    def change(header: dict, sharding: dict) -> None:
        header["__metadata__"]["DCP_SHARDING_INFO"] = text
        header["__metadata__"]["keep"] = "1"
    return change


def entry(name: str, **fields: Any) -> Callable[[dict, dict], None]:
    def change(header: dict, sharding: dict) -> None:
        header[name].update(fields)
        if "shape" in fields:
            sharding[name]["saved_offsets"] = [4] * len(fields["shape"])
    return change


def drop_info(header: dict, sharding: dict) -> None:
    del header["__metadata__"]["DCP_SHARDING_INFO"]


def extra_name(header: dict, sharding: dict) -> None:
    sharding["model.layers.9.mlp.up_proj.weight"] = {"saved_offsets": [0, 0]}


def lacking_name(header: dict, sharding: dict) -> None:
    del sharding[WO]


BROKEN: dict[str, tuple[Callable[[Path], None], str]] = {
    "overlap": (lambda f: rewrite(f / RANK2_A, offsets(WQ, [3, 0])),
                f"the pieces of '{WQ}' (shape [6, 4], from 2 files) overlap"),
    "gap": (lambda f: rewrite(f / RANK2_A, offsets(WQ, [5, 0])),
            f"the pieces of '{WQ}' (shape [8, 4], from 2 files) leave part of it unwritten"),
    "column_gap": (lambda f: rewrite(f / RANK2_A, offsets(WO, [0, 6])),
                   f"the pieces of '{WO}' (shape [3, 10], from 2 files) leave part of it unwritten"),
    "negative": (lambda f: rewrite(f / RANK2_A, offsets(WQ, [-1, 0])),
                 f"{RANK2_A}: DCP_SHARDING_INFO gives '{WQ}' no saved_offsets of non-negative integers"),
    "not_ints": (lambda f: rewrite(f / RANK2_A, offsets(WQ, [4.0, 0])), "no saved_offsets of non-negative"),
    "bool_offset": (lambda f: rewrite(f / RANK2_A, offsets(WQ, [True, 0])), "no saved_offsets of non-negative"),
    "wrong_axes": (lambda f: rewrite(f / RANK2_A, offsets(WQ, [4])),
                   f"{RANK2_A}: saved_offsets [4] of '{WQ}' do not match its shape [3, 4]"),
    "not_json": (lambda f: rewrite(f / RANK2_A, raw_info("{not json")), "DCP_SHARDING_INFO is not valid JSON"),
    "not_object": (lambda f: rewrite(f / RANK2_A, raw_info("[1, 2]")), "DCP_SHARDING_INFO is not a JSON object"),
    "no_info": (lambda f: rewrite(f / RANK2_A, drop_info),
                f"{RANK2_A}: no DCP_SHARDING_INFO in its __metadata__"),
    "extra_name": (lambda f: rewrite(f / RANK2_A, extra_name),
                   "DCP_SHARDING_INFO names 'model.layers.9.mlp.up_proj.weight', which the file does not hold"),
    "lacking_name": (lambda f: rewrite(f / RANK2_A, lacking_name), f"DCP_SHARDING_INFO does not place '{WO}'"),
    "dtypes": (lambda f: rewrite(f / RANK2_A, entry(WQ, dtype="I32")),
               f"the pieces of '{WQ}' disagree in dtype (float32 in {RANK1_A}, int32 in {RANK2_A})"),
    "axes": (lambda f: rewrite(f / RANK2_A, entry(WQ, shape=[12])),
             f"the pieces of '{WQ}' disagree in their number of axes"),
    "missing_rank": (lambda f: [(f / n).unlink() for n in (RANK1_A, "shard-00001-model-00002-of-00002.safetensors")],
                     "no shard files of rank 1 (shard-00001-*), though files of ranks up to 2 are there"),
    "counts": (lambda f: (f / RANK2_B).rename(f / "shard-00002-model-00002-of-00003.safetensors"),
               "the shard files disagree on their file count"),
    "file_number": (lambda f: (f / RANK2_B).rename(f / "shard-00002-model-00000-of-00002.safetensors"),
                    "shard-00002-model-00000-of-00002.safetensors: file number outside 1..2"),
    "truncated": (lambda f: os.truncate(f / RANK2_B, (f / RANK2_B).stat().st_size - 10),
                  f"{RANK2_B}: tensor '{W1}': data_offsets [60, 828] run past the end of the data (818 bytes); "
                  "the file is truncated"),
    "unknown_dtype": (lambda f: rewrite(f / RANK2_A, entry(SCALE, dtype="Q9", shape=[2, 2])),
                      f"{RANK2_A}: the piece of '{SCALE}' is Q9, which tclip cannot read"),
}


@pytest.fixture(scope="session")
def broken_root(hf_root: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("dcp_hf_broken")
    for case, (damage, _) in BROKEN.items():
        shutil.copytree(hf_root / "hf_ranks2" / "ckpt", root / case)
        damage(root / case)
    return root


@pytest.mark.parametrize("case", sorted(BROKEN))
@pytest.mark.parametrize("command", ["info", "report"])
def test_broken_folder_is_one_error_line(broken_root: Path, case: str, command: str) -> None:
    folder = broken_root / case
    before = sorted((p.name, p.stat().st_size) for p in folder.iterdir())
    result = run(command, folder)
    assert result.exit_code == 1, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"Error: {folder}: "), result.stderr
    assert BROKEN[case][1] in lines[0]
    assert "Traceback" not in result.output
    assert sorted((p.name, p.stat().st_size) for p in folder.iterdir()) == before


def test_clipping_a_folder_writes_nothing(hf_root: Path, tmp_path: Path) -> None:
    folder = tmp_path / "ckpt"
    shutil.copytree(hf_root / "hf_ranks2" / "ckpt", folder)
    before = {p.name: p.read_bytes() for p in folder.iterdir()}
    result = run("global", "--clip", "1", folder, "--out-dir", tmp_path / "out")
    assert result.exit_code == 1, result.output
    assert len(result.stderr.strip().splitlines()) == 1 and "Traceback" not in result.output
    assert {p.name: p.read_bytes() for p in folder.iterdir()} == before
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())
