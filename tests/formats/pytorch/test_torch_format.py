"""PyTorch files as a format (issue 17): every command on files torch wrote, views, tied storages,
rewrites that keep the pickle and the zip byte for byte, sharded sets, hostile files, no torch.

Files come from tests/fixtures/torch/ (written by torch, with what torch.load said about
them) and from tests/support/torch_helpers.py (written here, opcode by opcode, without torch).
Only the tests that load outputs back with torch itself need it installed.
"""

from __future__ import annotations

import json
import math
import shutil
import struct
import subprocess
import sys
import textwrap
import tracemalloc
import zipfile
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import support
from support import torch_helpers as th
from support.cli import run
import tclip
from tclip.formats import open_reader, registry
from tclip.formats.torch import reader as torch_format
from tclip.formats.torch.archive import load_torch_archive
from tclip.formats.torch.unpickler import StorageRef, TensorRef

FIXTURES = support.FIXTURES / "torch"
EXPECTED = json.loads((FIXTURES / "expected.json").read_text())
with np.load(FIXTURES / "expected.npz") as _npz:
    VALUES = {key: _npz[key] for key in _npz.files}
READABLE = [name for name in EXPECTED if name != "refused"]
REFUSED = sorted(EXPECTED["refused"])
HF_SET = FIXTURES / "hf_set"
BF16 = np.dtype(ml_dtypes.bfloat16)


def ok(*args):
    result = run(*args)
    assert result.exit_code == 0, result.stderr
    return result


def copy(tmp_path: Path, name: str) -> Path:
    shutil.copy(FIXTURES / name, tmp_path / name)
    return tmp_path / name


def read_values(path: Path) -> dict[str, np.ndarray]:
    with open_reader(path) as reader:
        return {name: reader.read(name) for name in reader.tensors}


def original(filename: str, name: str) -> np.ndarray:
    """A fixture tensor's values in its own dtype, as torch.load gave them."""
    values = VALUES[f"{filename}|{name}"]
    dtype = EXPECTED[filename]["tensors"][name]["dtype"]
    if dtype in ("bfloat16", "float8_e4m3fn"):
        return values.astype(BF16 if dtype == "bfloat16" else ml_dtypes.float8_e4m3fn)
    return values


def floating(filename: str) -> list[str]:
    return [n for n, t in EXPECTED[filename]["tensors"].items()
            if t["dtype"] in ("float16", "bfloat16", "float32", "float64", "float8_e4m3fn")]


def clipped(filename: str) -> list[str]:
    """The floating tensors a clip changes: a saved optimizer's state (``optimizer.state.*``) is left alone."""
    return [n for n in floating(filename) if not n.startswith("optimizer.state.")]


def stored_once(filename: str, names: list[str]) -> np.ndarray:
    """The values of ``names``, each stored element once (views of one storage share elements),
    in float64: what a global norm over them counts (DESIGN: "each stored element once")."""
    seen: dict[tuple[str, int], float] = {}
    for name in names:
        t = EXPECTED[filename]["tensors"][name]
        values = VALUES[f"{filename}|{name}"].astype(np.float64)
        where = t["offset"] + sum(np.indices(t["shape"], dtype=np.int64)[i] * s for i, s in enumerate(t["stride"]))
        for index, value in zip(np.reshape(where, -1).tolist(), values.reshape(-1).tolist()):
            seen[(t["storage"], index)] = value
    return np.array(list(seen.values()), np.float64)


def zip_ok(path: Path) -> bool:
    with zipfile.ZipFile(path) as archive:
        return archive.testzip() is None


def zip_layout(path: Path) -> list[tuple[str, int, int]]:
    with zipfile.ZipFile(path) as archive:
        return [(i.filename, i.header_offset, i.file_size) for i in archive.infolist()]


def changed_bytes(a: Path, b: Path) -> np.ndarray:
    x, y = np.fromfile(a, np.uint8), np.fromfile(b, np.uint8)
    assert x.size == y.size
    return np.flatnonzero(x != y)


def assert_untouched_but(source: Path, output: Path, names: list[str]) -> None:
    """The output differs from the source only inside the bytes of ``names`` and CRC fields."""
    archive = load_torch_archive(source)
    allowed = np.zeros(source.stat().st_size, bool)
    for name in names:
        ref = archive.tensors[name]
        storage = archive.storages[ref.storage.key]
        allowed[storage.offset:storage.offset + storage.nbytes] = True
    if archive.format == "zip":
        with zipfile.ZipFile(source) as z:
            for info in z.infolist():
                allowed[info.header_offset + 14:info.header_offset + 18] = True  # local header CRC
        raw = source.read_bytes()
        for signature, at in ((b"PK\x01\x02", 16), (b"PK\x07\x08", 4)):
            position = raw.find(signature)
            while position >= 0:
                allowed[position + at:position + at + 4] = True
                position = raw.find(signature, position + 1)
    changed = changed_bytes(source, output)
    assert allowed[changed].all(), changed[~allowed[changed]][:10]


# --------------------------------------------------------------------------- detection


@pytest.mark.parametrize("filename", READABLE + REFUSED)
def test_files_torch_wrote_are_recognised_by_content_whatever_their_name(tmp_path, filename):
    renamed = tmp_path / "weights.data"
    shutil.copy(FIXTURES / filename, renamed)
    assert registry.detect_format(renamed) == "pytorch"


def test_an_npz_named_pt_is_still_an_npz_and_a_torch_zip_named_npz_is_torch(tmp_path):
    with open(tmp_path / "grads.pt", "wb") as handle:
        np.savez(handle, w=np.ones(3, np.float32))
    assert registry.detect_format(tmp_path / "grads.pt") == "npz"
    shutil.copy(FIXTURES / "state_dict.pt", tmp_path / "state_dict.npz")
    assert registry.detect_format(tmp_path / "state_dict.npz") == "pytorch"


def test_a_folder_picks_up_bin_files_only_when_torch_wrote_them(tmp_path):
    shutil.copy(FIXTURES / "single.pt", tmp_path / "pytorch_model.bin")
    (tmp_path / "tokenizer.bin").write_bytes(bytes(range(256)) * 4)
    np.savez(tmp_path / "grads.npz", w=np.ones(3, np.float32))
    result = ok("report", "--json", tmp_path)
    files = [Path(json.loads(line)["file"]).name for line in result.stdout.splitlines()]
    assert files == ["grads.npz", "pytorch_model.bin"]
    named = run("report", tmp_path / "tokenizer.bin")
    assert named.exit_code == 1 and named.stderr.startswith("Error: ")
    assert "not a tensor file tclip knows" in named.stderr
    (tmp_path / "other.pt").write_bytes(bytes(range(256)) * 4)  # a .pt is taken for one whatever it holds
    assert "not a PyTorch file (neither the zip format" in run("report", tmp_path / "other.pt").stderr


# --------------------------------------------------------------------------- reading


@pytest.mark.parametrize("filename", READABLE)
def test_every_view_reads_as_torch_loaded_it(filename):
    rng = np.random.default_rng(3)
    with open_reader(FIXTURES / filename) as reader:
        assert reader.format_name == "pytorch"
        assert list(reader.tensors) == list(EXPECTED[filename]["tensors"])
        for name, info in reader.tensors.items():
            want = original(filename, name)
            assert info.shape == want.shape and info.dtype == want.dtype
            flat = want.reshape(-1)
            for start in range(info.size + 1):
                for stop in range(start, min(info.size, start + 9) + 1):
                    np.testing.assert_array_equal(reader.read_flat(name, start, stop), flat[start:stop])
            for _ in range(10):
                index = tuple(slice(a, a + rng.integers(0, n - a + 1)) for n in info.shape
                              for a in [int(rng.integers(0, n + 1))])
                np.testing.assert_array_equal(reader.read(name, index), want[index])
        assert [o.name for o in reader.others] == list(EXPECTED[filename]["others"])


def test_dense_views_are_one_run_of_the_file_and_the_others_are_gathered():
    with open_reader(FIXTURES / "views.pt") as reader:
        runs = {name for name in reader.tensors if reader.region(name) is not None}
        assert runs == {"embed.weight", "lm_head.weight", "attn.q", "attn.k", "attn.v", "base", "base_row"}
        assert all(reader.parallel_safe(name) for name in reader.tensors)


def big_views(tmp_path: Path, rows: int = 512, cols: int = 1024) -> tuple[Path, np.ndarray]:
    base = np.random.default_rng(1).standard_normal(rows * cols).astype(np.float32)
    views = {
        "grid": th.contiguous("0", (rows, cols)),
        "grid_t": th.View("0", 0, (cols, rows), (1, cols)),
        "column": th.View("0", 7, (rows,), (cols,)),
        "even_rows": th.View("0", 0, (rows // 2, cols), (2 * cols, 1)),
        "corner": th.View("0", cols + 3, (rows // 4, cols // 4), (cols, 1)),
        "every_other": th.View("0", 1, (rows, cols // 2), (cols, 2)),
    }
    return th.save(tmp_path / "big.pt", {"0": base}, views), base.reshape(rows, cols)


def test_views_of_a_big_storage_are_read_in_bounded_pieces(tmp_path, monkeypatch):
    path, grid = big_views(tmp_path)
    expected = {"grid": grid, "grid_t": grid.T, "column": grid[:, 7], "even_rows": grid[::2],
                "corner": grid[1:129, 3:259], "every_other": grid[:, 1::2]}
    reads: list[int] = []
    real = torch_format.pread_into
    monkeypatch.setattr(torch_format, "pread_into", lambda fd, buffer, *a: (reads.append(len(buffer)),
                                                                            real(fd, buffer, *a)))
    with open_reader(path) as reader:
        for name, want in expected.items():
            flat = want.reshape(-1)
            for start in range(0, flat.size, 50_000):  # blocks of 200 kB, as a pass would read them
                stop = min(flat.size, start + 50_000)
                reads.clear()
                np.testing.assert_array_equal(reader.read_flat(name, start, stop), flat[start:stop])
                if reader.region(name) is None:
                    assert max(reads) <= max(2 * 4 * (stop - start), torch_format._SMALL_READ), name
        tracemalloc.start()
        column = reader.read_flat("column", 0, grid.shape[0])  # 2 kB of values over a 2 MiB storage
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        np.testing.assert_array_equal(column, grid[:, 7])
        assert peak < 2 * torch_format._SMALL_READ


@given(st.data())
def test_pieces_cover_a_block_once_and_each_is_one_bounded_read(data):
    ndim = data.draw(st.integers(1, 3))
    shape = tuple(data.draw(st.lists(st.integers(1, 8), min_size=ndim, max_size=ndim)))
    stride = tuple(data.draw(st.lists(st.integers(0, 300), min_size=ndim, max_size=ndim)))
    offset = data.draw(st.integers(0, 4))
    lo = tuple(data.draw(st.integers(0, n - 1)) for n in shape)
    extent = tuple(data.draw(st.integers(1, n - a)) for n, a in zip(shape, lo))
    small = data.draw(st.sampled_from([4, 64, 1024]))
    ref = TensorRef(StorageRef("0", np.dtype("<f4"), 1 << 20, "cpu", "FloatStorage"), np.dtype("<f4"), offset,
                    shape, stride)
    seen = np.zeros(extent, int)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(torch_format, "_SMALL_READ", small * 4)
        for index, first, span in torch_format._pieces(torch_format.View(ref, None, False), lo, extent):
            sizes = [s.stop - s.start for s in index]
            seen[index] += 1
            assert span == sum((n - 1) * d for n, d in zip(sizes, stride)) + 1
            assert span <= 2 * math.prod(sizes) or span <= small
            assert first == offset + sum((a + s.start) * d for a, s, d in zip(lo, index, stride))
    assert (seen == 1).all()


def test_a_negative_view_reads_negated_and_is_written_back_negated(tmp_path):
    values = np.array([3.0, -4.0, 12.0], np.float32)
    path = th.save(tmp_path / "n.pt", {"0": values}, {"w": th.View("0", 0, (3,), (1,), neg=True)})
    with open_reader(path) as reader:
        assert reader.region("w") is None
        np.testing.assert_array_equal(reader.read("w"), -values)
    ok("value", "--min", "-5", "--max", "5", path)
    with open_reader(tmp_path / "n.clipped.pt") as reader:
        np.testing.assert_array_equal(reader.read("w"), [-3.0, 4.0, -5.0])
    stored = load_torch_archive(tmp_path / "n.clipped.pt").storages["0"]
    raw = (tmp_path / "n.clipped.pt").read_bytes()[stored.offset:stored.offset + 12]
    np.testing.assert_array_equal(np.frombuffer(raw, "<f4"), [3.0, -4.0, 5.0])


def test_a_big_endian_file_is_read_and_rewritten_big_endian(tmp_path):
    values = np.array([[3.0, 4.0], [0.0, 0.0]], np.float32)
    path = th.save(tmp_path / "be.pt", {"0": values.reshape(-1)}, {"w": th.contiguous("0", (2, 2))},
                   byteorder="big", descriptors=False)
    with open_reader(path) as reader:
        assert reader.tensors["w"].dtype == np.dtype(">f4")
        np.testing.assert_array_equal(reader.read("w"), values)
    ok("norm", "--clip", "1", path)
    out = tmp_path / "be.clipped.pt"
    with open_reader(out) as reader:
        np.testing.assert_array_equal(reader.read("w"), np.array([[0.6, 0.8], [0, 0]], np.float32))
    assert zip_ok(out)


# --------------------------------------------------------------------------- info and report


def test_info_lists_tensors_values_and_storages():
    result = run("info", FIXTURES / "views.pt", FIXTURES / "checkpoint.pt")
    assert result.exit_code == 0, result.stderr
    out = result.stdout
    assert "views.pt  (pytorch, 3.4 kB)" in out
    assert "one storage: embed.weight, lm_head.weight" in out
    assert "one storage: base, base_t, base_slice, base_row, base_col" in out
    assert "optimizer.state.0.exp_avg_sq" in out
    lines = [line.split(maxsplit=2) for line in out.splitlines()]
    assert ["step", "int", "(value 5)"] in lines
    assert ["config.dtype", "dtype", "(value torch.bfloat16)"] in lines


def test_info_json_lists_the_tensors_sharing_a_storage():
    info = json.loads(ok("info", "--json", FIXTURES / "views.pt").stdout)
    assert sorted(map(sorted, info["shared_storage"])) == sorted(map(sorted, EXPECTED["views.pt"]["shared"]))
    assert all(t["attrs"] == {} for t in info["tensors"])  # layout is no attribute: diff compares those


def test_the_same_tensors_saved_in_two_layouts_are_equal_for_diff():
    result = run("diff", FIXTURES / "legacy.pt", FIXTURES / "views.pt")  # other storage keys and formats
    assert result.exit_code == 0, result.stdout


def test_info_reads_the_pickle_and_directory_only(tmp_path):
    path = copy(tmp_path, "state_dict.pt")
    archive = load_torch_archive(path)
    raw = bytearray(path.read_bytes())
    for storage in archive.storages.values():  # storages' bytes damaged: their CRCs fail
        raw[storage.offset:storage.offset + storage.nbytes] = b"\xff" * storage.nbytes
    path.write_bytes(raw)
    assert "19 tensors" in ok("info", path).stdout


@pytest.mark.parametrize("filename", READABLE)
def test_report_norms_are_exact(filename):
    report = json.loads(ok("report", "--json", FIXTURES / filename).stdout)
    norms = {t["name"]: t["norm"] for t in report["tensors"]}
    for name in floating(filename):
        values = VALUES[f"{filename}|{name}"].astype(np.float64)
        assert norms[name] == float(np.sqrt(np.sum(values * values))), name
    # an optimizer's state is shown, not counted in the global norm; views of one storage count
    # each stored element once
    counted = stored_once(filename, clipped(filename))
    assert report["global_norm"] == pytest.approx(float(np.sqrt(np.sum(counted * counted))), rel=1e-15)


def test_report_axes_stats_and_the_gate(tmp_path):
    report = json.loads(ok("report", "--json", "--axes", "1", "--stats", FIXTURES / "views.pt").stdout)
    base_t = VALUES["views.pt|base_t"].astype(np.float64)
    line = next(t for t in report["tensors"] if t["name"] == "base_t")
    assert line["max_slice_norm"] == float(np.sqrt((base_t ** 2).sum(axis=1)).max())
    gate = run("report", "-q", "--max-norm", "100", FIXTURES / "views.pt")
    assert gate.exit_code == 3 and "above 100" in gate.stderr
    assert run("report", "-q", "--max-norm", "1000", FIXTURES / "views.pt").exit_code == 0


def test_report_summary_across_steps_saved_by_torch_save(tmp_path):
    rng = np.random.default_rng(2)
    for step in (100, 200, 300, 400):
        grads = {f"model.layers.{i}.self_attn.q_proj.weight": rng.standard_normal((8, 8)).astype(np.float32)
                 for i in range(3)}
        if step == 300:
            grads["model.layers.1.self_attn.q_proj.weight"][2, 2] = np.nan
        th.save_arrays(tmp_path / f"step_{step}.pt", grads, values={"step": th.num(step)})
    result = ok("report", "--summary", "--json", str(tmp_path / "step_*.pt"))
    rows = [json.loads(line) for line in result.stdout.splitlines()]
    assert [Path(r["file"]).name for r in rows] == ["step_100.pt", "step_200.pt", "step_300.pt", "step_400.pt"]
    text = ok("report", "--summary", str(tmp_path / "step_*.pt")).stdout
    assert "NaN/Inf appeared in 1 tensor at step_300: model.layers.1.self_attn.q_proj.weight" in text


def test_diff_of_a_pt_and_the_safetensors_of_the_same_model(tmp_path):
    source = copy(tmp_path, "state_dict.pt")
    ok("norm", "--clip", "1e30", "-o", tmp_path / "sd.safetensors", source)
    same = run("diff", source, tmp_path / "sd.safetensors")
    assert same.exit_code == 0, same.stdout + same.stderr
    ok("norm", "--clip", "1", "--include", "model.layers.17.self_attn.q_proj.weight", "-o",
       tmp_path / "clipped.safetensors", source)
    differ = run("diff", "--json", source, tmp_path / "clipped.safetensors")
    assert differ.exit_code == 3
    report = json.loads(differ.stdout)
    assert report["tensors_compared"] == 19
    assert [t["name"] for t in report["tensors"] if t["differs"]] == ["model.layers.17.self_attn.q_proj.weight"]


def test_diff_of_two_checkpoints_compares_saved_numbers(tmp_path):
    th.save_arrays(tmp_path / "a.pt", {"w": np.ones(3, np.float32)}, values={"step": th.num(5)})
    th.save_arrays(tmp_path / "b.pt", {"w": np.ones(3, np.float32)}, values={"step": th.num(6)})
    result = run("diff", "--json", tmp_path / "a.pt", tmp_path / "b.pt")
    assert result.exit_code == 3
    step = next(t for t in json.loads(result.stdout)["tensors"] if t["name"] == "step")
    assert step["outside"] == 1


# --------------------------------------------------------------------------- clipping


def test_norm_rewrites_only_the_storages_and_keeps_the_zip(tmp_path):
    source = copy(tmp_path, "state_dict.pt")
    ok("norm", "--clip", "1", source)
    output = tmp_path / "state_dict.clipped.pt"
    assert zip_layout(output) == zip_layout(source)
    assert zip_ok(output)
    with zipfile.ZipFile(source) as a, zipfile.ZipFile(output) as b:
        assert a.read("state_dict/data.pkl") == b.read("state_dict/data.pkl")
    names = floating("state_dict.pt")
    assert_untouched_but(source, output, names)
    got = read_values(output)
    for name in EXPECTED["state_dict.pt"]["tensors"]:
        want = original("state_dict.pt", name)
        if name in names:
            want = tclip.clip_by_norm(want, 1.0)
        np.testing.assert_array_equal(got[name], want, err_msg=name)


@pytest.mark.parametrize("args", [["global", "--clip", "0.5"], ["average", "--clip", "0.01"],
                                  ["value", "--min", "-0.1", "--max", "0.1"],
                                  ["norm", "--clip", "0.3", "--axes", "-1"]],
                         ids=["global", "average", "value", "norm-axes"])
def test_every_mode_on_a_training_checkpoint(tmp_path, args):
    source = copy(tmp_path, "checkpoint.pt")
    ok(*args, source)
    output = tmp_path / "checkpoint.clipped.pt"
    names = clipped("checkpoint.pt")
    arrays = [original("checkpoint.pt", n) for n in names]
    if args[0] == "global":
        want = dict(zip(names, tclip.clip_by_global_norm(arrays, 0.5)[0]))
    elif args[0] == "average":
        want = {n: tclip.clip_by_average_norm(a, 0.01) for n, a in zip(names, arrays)}
    elif args[0] == "value":
        want = {n: tclip.clip_by_value(a, -0.1, 0.1) for n, a in zip(names, arrays)}
    else:
        want = {n: tclip.clip_by_norm(a, 0.3, axes=-1) if a.ndim else a for n, a in zip(names, arrays)}
    got = read_values(output)
    for name in names:
        np.testing.assert_array_equal(got[name], want[name], err_msg=name)
    with open_reader(source) as a, open_reader(output) as b:
        assert a.others == b.others and a._values == b._values
    assert_untouched_but(source, output, names)


def test_tied_weights_are_scaled_once_and_stay_one_storage(tmp_path):
    embed = np.random.default_rng(3).standard_normal((6, 4)).astype(np.float32)
    path = th.save(tmp_path / "tied.pt", {"0": embed.reshape(-1), "1": np.full(4, 3, np.float32)},
                   {"model.embed_tokens.weight": th.contiguous("0", (6, 4)),
                    "lm_head.weight": th.contiguous("0", (6, 4)),
                    "model.norm.weight": th.contiguous("1", (4,))})
    ok("norm", "--clip", "1", path)
    output = tmp_path / "tied.clipped.pt"
    archive = load_torch_archive(output)
    assert archive.shared == {"0": ("model.embed_tokens.weight", "lm_head.weight")}
    got = read_values(output)
    np.testing.assert_array_equal(got["lm_head.weight"], tclip.clip_by_norm(embed, 1.0))
    np.testing.assert_array_equal(got["model.embed_tokens.weight"], got["lm_head.weight"])
    assert_untouched_but(path, output, ["lm_head.weight", "model.norm.weight"])

    alone = run("norm", "--clip", "1", "--exclude", "lm_head.weight", "--force", path)
    assert alone.exit_code == 1
    assert alone.stderr == (f"Error: {path}: clipping tensor 'model.embed_tokens.weight' would change tensor "
                            "'lm_head.weight' too (they share storage in the file), which is not selected; nothing "
                            "was written. Select both, or convert to safetensors, which stores each apart\n")


@pytest.mark.parametrize("args", [["norm", "--clip", "1"], ["norm", "--clip", "30", "--axes", "1"]])
def test_views_that_would_take_different_factors_are_refused(tmp_path, args):
    source = copy(tmp_path, "views.pt")
    result = run(*args, source)
    assert result.exit_code == 1
    assert result.stderr.startswith(f"Error: {source}: tensors 'base' and ")
    assert "share storage in the file" in result.stderr and len(result.stderr.splitlines()) == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["views.pt"]
    converted = run(*args, "-o", tmp_path / "views.safetensors", source)  # stored apart: fine
    assert converted.exit_code == 0, converted.stderr


def test_global_scales_every_view_of_a_storage_once(tmp_path):
    source = copy(tmp_path, "views.pt")
    report = json.loads(ok("global", "--clip", "1", "--json", source).stdout)
    names = list(EXPECTED["views.pt"]["tensors"])
    counted = stored_once("views.pt", names)  # each stored element once
    assert counted.size == 143  # of the views' 231 values
    assert report["global_norm"] == pytest.approx(float(np.sqrt(np.sum(counted * counted))), rel=1e-15)
    clipped, _ = tclip.clip_by_global_norm([original("views.pt", n) for n in names], 1.0,
                                           use_norm=report["global_norm"])
    got = read_values(tmp_path / "views.clipped.pt")
    for name, want in zip(names, clipped):
        np.testing.assert_array_equal(got[name], want, err_msg=name)
    np.testing.assert_array_equal(got["base_t"], got["base"].T)


def test_disjoint_views_of_one_storage_take_their_own_factors(tmp_path):
    source = copy(tmp_path, "views.pt")
    ok("norm", "--clip", "3", "--include", "attn.*", source)
    got = read_values(tmp_path / "views.clipped.pt")
    for name in ("attn.q", "attn.k", "attn.v"):
        np.testing.assert_array_equal(got[name], tclip.clip_by_norm(original("views.pt", name), 3.0))
    ok("norm", "--clip", "3", "--include", "attn.q", "--force", source)
    got = read_values(tmp_path / "views.clipped.pt")
    np.testing.assert_array_equal(got["attn.k"], original("views.pt", "attn.k"))  # 4.1 > 3, not selected
    np.testing.assert_array_equal(got["attn.q"], tclip.clip_by_norm(original("views.pt", "attn.q"), 3.0))


def test_interleaved_views_share_a_storage_but_no_element(tmp_path):
    values = np.arange(1, 17, dtype=np.float32)
    path = th.save(tmp_path / "i.pt", {"0": values}, {"even": th.View("0", 0, (8,), (2,)),
                                                     "odd": th.View("0", 1, (8,), (2,))})
    with open_reader(path) as reader:
        assert reader.shared_storage() == [("even", "odd")] and reader.overlaps() == []
    ok("norm", "--clip", "10", path)
    got = read_values(tmp_path / "i.clipped.pt")
    np.testing.assert_array_equal(got["even"], tclip.clip_by_norm(values[::2], 10.0))
    np.testing.assert_array_equal(got["odd"], tclip.clip_by_norm(values[1::2], 10.0))


def test_too_many_overlapping_views_of_one_storage_are_refused(tmp_path):
    views = {f"v{i}": th.View("0", i, (1000,), (1,)) for i in range(500)}  # 124,750 overlapping pairs
    path = th.save(tmp_path / "many.pt", {"0": np.zeros(2000, np.float32)}, views)
    assert run("info", path).exit_code == 0
    result = run("report", path)
    assert result.exit_code == 1
    assert result.stderr == (f"Error: {path}: more than 100000 pairs of views of one storage overlap; tclip refuses "
                             "such a file\n")


def test_value_clip_of_overlapping_views_is_one_clip_per_element(tmp_path):
    source = copy(tmp_path, "views.pt")
    ok("value", "--min", "-0.5", "--max", "20", source)
    got = read_values(tmp_path / "views.clipped.pt")
    for name in EXPECTED["views.pt"]["tensors"]:
        np.testing.assert_array_equal(got[name], np.clip(original("views.pt", name), -0.5, 20), err_msg=name)


def test_big_views_rewritten_alike_for_any_threads_and_memory(tmp_path):
    path, grid = big_views(tmp_path)
    outputs = []
    for i, options in enumerate([["--threads", "1"], ["--threads", "2", "--memory", "16M"], ["--memory", "64M"]]):
        out = tmp_path / f"out{i}.pt"
        ok("global", "--clip", "1", *options, "-o", out, path)
        outputs.append(out.read_bytes())
    assert outputs[0] == outputs[1] == outputs[2]
    assert zip_ok(tmp_path / "out0.pt")
    got = read_values(tmp_path / "out0.pt")
    np.testing.assert_array_equal(got["grid_t"], got["grid"].T)
    np.testing.assert_array_equal(got["every_other"], got["grid"][:, 1::2])


def test_converting_to_safetensors_materialises_views_and_asks_about_values(tmp_path):
    ok("norm", "--clip", "2", "-o", tmp_path / "views.safetensors", FIXTURES / "views.pt")
    from safetensors.numpy import load_file

    loaded = load_file(tmp_path / "views.safetensors")
    for name in EXPECTED["views.pt"]["tensors"]:
        np.testing.assert_array_equal(loaded[name], tclip.clip_by_norm(original("views.pt", name), 2.0))
    refused = run("norm", "--clip", "1", "-o", tmp_path / "ck.safetensors", FIXTURES / "checkpoint.pt")
    assert refused.exit_code == 1 and "safetensors cannot hold optimizer.param_groups.0.lr (float)" in refused.stderr
    assert not (tmp_path / "ck.safetensors").exists()
    dropped = run("norm", "--clip", "1", "--drop-nonnumeric", "-o", tmp_path / "ck.safetensors",
                  FIXTURES / "checkpoint.pt")
    assert dropped.exit_code == 0 and dropped.stderr.startswith("Warning: ")
    assert sorted(load_file(tmp_path / "ck.safetensors")) == sorted(EXPECTED["checkpoint.pt"]["tensors"])


def test_writing_a_pt_from_another_format_is_refused(tmp_path):
    np.savez(tmp_path / "g.npz", w=np.ones(3, np.float32))
    result = run("norm", "--clip", "1", "-o", tmp_path / "g.pt", tmp_path / "g.npz")
    assert result.exit_code == 1
    assert result.stderr == (f"Error: {tmp_path / 'g.pt'}: tclip writes a PyTorch file only as a rewrite of one "
                             "(its pickle is kept byte for byte); write .safetensors instead\n")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["g.npz"]


def test_in_place_dry_run_and_an_existing_output(tmp_path):
    source = copy(tmp_path, "single.pt")
    before = source.read_bytes()
    ok("norm", "--clip", "0.5", "--dry-run", source)
    assert source.read_bytes() == before and sorted(p.name for p in tmp_path.iterdir()) == ["single.pt"]
    ok("norm", "--clip", "0.5", "--in-place", source)
    assert len(source.read_bytes()) == len(before) and source.read_bytes() != before
    want = tclip.clip_by_norm(original("single.pt", "single"), 0.5)
    np.testing.assert_array_equal(read_values(source)["single"], want)
    ok("norm", "--clip", "0.1", source)
    again = run("norm", "--clip", "0.1", source)
    assert again.exit_code == 1 and "output already exists" in again.stderr


def test_a_zip_with_crcs_in_its_local_headers(tmp_path):
    path = th.save_arrays(tmp_path / "plain.pt", {"w": np.arange(1000, dtype=np.float32)}, descriptors=False)
    ok("norm", "--clip", "1", path)
    output = tmp_path / "plain.clipped.pt"
    assert zip_ok(output)
    with zipfile.ZipFile(output) as archive:
        info = archive.getinfo("archive/data/0")
        local_crc = struct.unpack("<L", output.read_bytes()[info.header_offset + 14:info.header_offset + 18])[0]
        assert local_crc == info.CRC == __import__("zlib").crc32(archive.read(info))


def test_the_legacy_format_is_rewritten_too(tmp_path):
    source = copy(tmp_path, "legacy_state_dict.pt")
    ok("global", "--clip", "1", source)
    names = floating("legacy_state_dict.pt")
    clipped, _ = tclip.clip_by_global_norm([original("legacy_state_dict.pt", n) for n in names], 1.0)
    got = read_values(tmp_path / "legacy_state_dict.clipped.pt")
    for name, want in zip(names, clipped):
        np.testing.assert_array_equal(got[name], want, err_msg=name)
    assert_untouched_but(source, tmp_path / "legacy_state_dict.clipped.pt", names)


# --------------------------------------------------------------------------- sharded sets


def hf_values() -> dict[str, np.ndarray]:
    with np.load(HF_SET / "expected.npz") as data:
        return {key: data[key] for key in data.files}


def test_a_hub_sharded_checkpoint_is_one_set(tmp_path):
    index = HF_SET / "pytorch_model.bin.index.json"
    values = hf_values()
    names = list(json.loads(index.read_text())["weight_map"])
    tied = {name for shard in HF_SET.glob("*.bin") for name in _tied_names(shard)}
    assert tied  # the fixture ties lm_head.weight to the embedding: counted once
    norm = tclip.global_norm([values[n] for n in names if n not in tied])
    clipped, _ = tclip.clip_by_global_norm([values[n] for n in names], 1.0, use_norm=norm)
    result = json.loads(ok("global", "--clip", "1", "--json", "--out-dir", tmp_path / "out", index).stdout)
    assert result["global_norm"] == norm
    out_index = tmp_path / "out" / "pytorch_model.bin.index.json"
    assert json.loads(out_index.read_text()) == json.loads(index.read_text())  # total_size counts tied once
    got = read_values(tmp_path / "out" / "pytorch_model-00001-of-00003.bin")
    got.update(read_values(tmp_path / "out" / "pytorch_model-00002-of-00003.bin"))
    got.update(read_values(tmp_path / "out" / "pytorch_model-00003-of-00003.bin"))
    for name, want in zip(names, clipped):
        np.testing.assert_array_equal(got[name], want, err_msg=name)
    assert load_torch_archive(tmp_path / "out" / "pytorch_model-00001-of-00003.bin").shared
    report = json.loads(ok("report", "--json", out_index).stdout)
    assert report["global_norm"] == pytest.approx(1.0, rel=1e-6)
    assert run("diff", index, out_index).exit_code == 3
    assert run("report", "--json", tmp_path / "out").exit_code == 0  # a folder holding the index


def _tied_names(shard: Path) -> list[str]:
    """Tensors of a shard that are identical views of an earlier one (tied weights)."""
    seen, tied = set(), []
    for name, ref in load_torch_archive(shard).tensors.items():
        key = (ref.storage.key, ref.offset, ref.shape, ref.stride)
        if key in seen:
            tied.append(name)
        seen.add(key)
    return tied


def test_a_checkpoint_the_hub_writes_now(tmp_path):
    torch = pytest.importorskip("torch")
    hub = pytest.importorskip("huggingface_hub")
    generator = torch.Generator().manual_seed(5)
    sd = {f"model.layers.{i}.mlp.down_proj.weight": torch.randn(32, 64, generator=generator) for i in range(6)}
    sd["model.embed_tokens.weight"] = torch.randn(50, 32, generator=generator)
    sd["lm_head.weight"] = sd["model.embed_tokens.weight"]
    hub.save_torch_state_dict(sd, tmp_path, safe_serialization=False, max_shard_size="20KB")
    ok("global", "--clip", "2", "--in-place", tmp_path / "pytorch_model.bin.index.json")
    loaded = {}
    for shard in sorted(tmp_path.glob("*.bin")):
        loaded.update(torch.load(shard, weights_only=True))
    # lm_head.weight is the embedding's storage: one parameter, counted once
    total = torch.sqrt(sum(t.double().square().sum() for n, t in sd.items() if n != "lm_head.weight"))
    for name, tensor in sd.items():
        assert torch.equal(loaded[name], (tensor.double() * (2 / total)).float()), name
    assert loaded["lm_head.weight"].untyped_storage().data_ptr() == \
        loaded["model.embed_tokens.weight"].untyped_storage().data_ptr()


# --------------------------------------------------------------------------- hostile files


def laughs(levels: int = 4, width: int = 1000) -> bytes:
    """A list of ``width`` references to a list of ``width`` references to ... : ``width ** levels``
    leaves from a few kilobytes of pickle."""
    ops = b""
    for level in range(levels):
        item = b"K\x00" if level == 0 else b"h" + bytes([level - 1])
        ops += b"](" + item * width + b"eq" + bytes([level]) + (b"0" if level < levels - 1 else b"")
    return ops


def pickled_zip(path: Path, pairs: list[tuple[str, bytes]], members: dict[str, bytes]) -> Path:
    pickle = b"\x80\x02" + th.mapping(pairs) + b"."
    entries = [("archive/data.pkl", pickle)] + [(f"archive/data/{k}", v) for k, v in members.items()]
    path.write_bytes(th.zip_archive(entries))
    return path


def hostile_files(folder: Path) -> dict[str, Path]:
    files = {name: Path(shutil.copy(FIXTURES / name, folder / name)) for name in REFUSED}
    four = np.zeros(4, np.float32)
    w = th.tensor_opcodes(th.contiguous("0", (4,)), four)
    files["bomb.pt"] = pickled_zip(folder / "bomb.pt", [("w", w), ("bomb", laughs())], {"0": four.tobytes()})
    files["deep.pt"] = pickled_zip(folder / "deep.pt", [("w", w), ("deep", b"]" * 5000 + b"a" * 4999)],
                                   {"0": four.tobytes()})
    files["too_big.pt"] = th.save(folder / "too_big.pt", {"0": four}, {"w": th.contiguous("0", (400,))})
    # CVE-2026-24747-like: the pickle declares 256 elements, the member holds 4
    files["lying.pt"] = pickled_zip(folder / "lying.pt", [("w", th.tensor_opcodes(th.contiguous("0", (4,)),
                                                                                   np.zeros(256, np.float32)))],
                                    {"0": four.tobytes()})
    files["twice.pt"] = pickled_zip(folder / "twice.pt", [("a", w), ("b", th.tensor_opcodes(
        th.contiguous("0", (4,)), np.zeros(1 << 20, np.float32)))], {"0": four.tobytes()})
    files["nowhere.pt"] = pickled_zip(folder / "nowhere.pt", [("w", th.tensor_opcodes(th.contiguous("9", (4,)), four))],
                                      {"0": four.tobytes()})
    whole = (FIXTURES / "state_dict.pt").read_bytes()
    (folder / "truncated.pt").write_bytes(whole[: len(whole) // 2])
    files["truncated.pt"] = folder / "truncated.pt"
    (folder / "garbage.bin").write_bytes(b"\x80\x02garbage" * 10)
    files["garbage.bin"] = folder / "garbage.bin"
    return files


HOSTILE = REFUSED + ["bomb.pt", "deep.pt", "too_big.pt", "lying.pt", "twice.pt", "nowhere.pt", "truncated.pt",
                     "garbage.bin"]


@pytest.mark.parametrize("command", [["info"], ["report"], ["report", "--summary"], ["norm", "--clip", "1"],
                                     ["global", "--clip", "1", "-o", "out.safetensors"]],
                         ids=["info", "report", "summary", "norm", "convert"])
@pytest.mark.parametrize("name", HOSTILE)
def test_a_hostile_file_is_one_error_and_nothing_else(tmp_path, monkeypatch, name, command):
    folder = tmp_path / "in"
    folder.mkdir()
    path = hostile_files(folder)[name]
    before = {p.name: p.read_bytes() for p in folder.iterdir()}
    marker = tmp_path / "marker"
    monkeypatch.setenv("TCLIP_PAYLOAD_MARKER", str(marker))
    monkeypatch.chdir(tmp_path)
    result = run(*command, path)
    assert result.exit_code == 1, result.stdout + result.stderr
    lines = result.stderr.splitlines()
    assert lines[0].startswith(f"Error: {path}: ") and "Traceback" not in result.stderr
    assert len([line for line in lines if line.startswith("Error: ")]) == 1
    assert not marker.exists()
    assert {p.name: p.read_bytes() for p in folder.iterdir()} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in"]


def test_the_refusals_say_what_was_found_and_what_to_do(tmp_path):
    messages = {name: run("info", FIXTURES / name).stderr for name in REFUSED}
    for name, words in EXPECTED["refused"].items():
        assert words in messages[name], messages[name]
    assert "save the state_dict" in messages["module.pt"]
    assert "TorchScript" in messages["torchscript.pt"]


# --------------------------------------------------------------------------- without torch


def test_every_command_runs_with_torch_unimportable(tmp_path):
    for name in ("views.pt", "checkpoint.pt", "legacy.pt"):
        shutil.copy(FIXTURES / name, tmp_path / name)
    shutil.copytree(HF_SET, tmp_path / "hf")
    script = textwrap.dedent("""
        import json, sys
        sys.modules["torch"] = None  # "import torch" raises ImportError
        from click.testing import CliRunner
        from tclip.cli import cli
        commands = [
            ["info", "views.pt", "checkpoint.pt", "legacy.pt"],
            ["report", "--axes", "1", "views.pt", "checkpoint.pt"],
            ["report", "--summary", "views.pt", "legacy.pt"],
            ["global", "--clip", "1", "views.pt"],
            ["norm", "--clip", "1", "checkpoint.pt"],
            ["value", "--min", "-1", "--max", "1", "-o", "legacy.safetensors", "legacy.pt"],
            ["diff", "legacy.pt", "views.pt"],
            ["global", "--clip", "1", "--out-dir", "out", "hf/pytorch_model.bin.index.json"],
        ]
        codes = [CliRunner().invoke(cli, c).exit_code for c in commands]
        print(json.dumps({"codes": codes, "torch": sys.modules["torch"] is None}))
    """)
    result = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout) == {"codes": [0, 0, 0, 0, 0, 0, 0, 0], "torch": True}
    assert (tmp_path / "out" / "pytorch_model.bin.index.json").exists()


# --------------------------------------------------------------------------- torch loads the outputs


@pytest.mark.parametrize("filename", ["state_dict.pt", "checkpoint.pt", "views.pt", "legacy.pt", "single.pt",
                                      "archive_prefix.pt", "legacy_state_dict.pt"])
def test_torch_loads_every_output_with_the_clipped_values(tmp_path, filename):
    torch = pytest.importorskip("torch")
    source = copy(tmp_path, filename)
    report = json.loads(ok("global", "--clip", "0.5", "--json", source).stdout)
    output = tmp_path / filename.replace(".pt", ".clipped.pt")
    before = torch.load(source, weights_only=True)
    after = torch.load(output, weights_only=True)
    names = clipped(filename)
    norm = None
    if EXPECTED[filename]["shared"]:  # views of one storage: each stored element once
        counted = stored_once(filename, names)
        norm = report["global_norm"]
        assert norm == pytest.approx(float(np.sqrt(np.sum(counted * counted))), rel=1e-15)
    want = dict(zip(names, tclip.clip_by_global_norm([original(filename, n) for n in names], 0.5,
                                                     use_norm=norm)[0]))
    flat_before, flat_after = _flatten(before, Path(filename).stem), _flatten(after, Path(filename).stem)
    assert list(flat_before) == list(flat_after)
    pointers: dict[int, int] = {}
    for name, value in flat_before.items():
        got = flat_after[name]
        if not isinstance(value, torch.Tensor):
            assert got == value or (got != got and value != value), name
            continue
        assert (got.shape, got.stride(), got.storage_offset(), got.dtype) == \
            (value.shape, value.stride(), value.storage_offset(), value.dtype), name
        # tensors that shared a storage still do
        key = value.untyped_storage().data_ptr()
        assert pointers.setdefault(key, got.untyped_storage().data_ptr()) == got.untyped_storage().data_ptr()
        if name in want:
            expected = np.asarray(want[name])
            if expected.dtype in (BF16, np.dtype(ml_dtypes.float8_e4m3fn)):  # exact in float32
                expected, got = expected.astype(np.float32), got.float()
            assert torch.equal(got, torch.from_numpy(expected)), name
        else:
            assert torch.equal(got.resolve_conj(), value.resolve_conj()), name


def _flatten(value, root, prefix=()):
    import torch

    if isinstance(value, torch.Tensor):
        return {".".join(prefix) or root: value}
    if isinstance(value, dict) and value:
        out = {}
        for key, item in value.items():
            out.update(_flatten(item, root, (*prefix, str(key))))
        return out
    if isinstance(value, (list, tuple)) and any(isinstance(v, (dict, list, tuple, torch.Tensor)) for v in value):
        out = {}
        for index, item in enumerate(value):
            out.update(_flatten(item, root, (*prefix, str(index))))
        return out
    return {".".join(prefix) or root: value}


def test_a_quantized_weight_sharing_bytes_with_another_tensor_is_not_clipped(tmp_path):
    # FP8 codes with a per-tensor scale (compressed-tensors' names), and a second tensor viewing
    # the first rows of the codes: the weight is clipped through its scale, the view through its
    # values, which would scale the shared codes twice.
    torch = pytest.importorskip("torch")
    codes = torch.tensor(np.linspace(-2, 2, 32, dtype=np.float32).reshape(4, 8)).to(torch.float8_e4m3fn)
    path = tmp_path / "q.pt"
    torch.save({"model.layers.0.mlp.up_proj.weight": codes,
                "model.layers.0.mlp.up_proj.weight_scale": torch.tensor([0.5]),
                "alias": codes[:2], "model.norm.weight": torch.ones(8)}, path)
    before = path.read_bytes()
    result = run("global", "--clip", "0.1", path)
    assert result.exit_code == 1
    assert result.stderr == (f"Error: {path}: the quantized weight 'model.layers.0.mlp.up_proj.weight' shares bytes "
                             "in the file with tensor 'alias', and global would rewrite them in two ways (its scales, "
                             "the other's values); nothing was written\n")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["q.pt"] and path.read_bytes() == before
    converted = run("global", "--clip", "0.1", "-o", tmp_path / "q.safetensors", path)  # stored apart: fine
    assert converted.exit_code == 0, converted.stderr


def test_a_saved_optimizer_state_is_left_alone_unless_included(tmp_path):
    # What a training loop saves: the model, the optimizer's state_dict (Adam moments, step
    # counts under "state", hyperparameters under "param_groups") and the step.
    torch = pytest.importorskip("torch")
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    optimizer = torch.optim.Adam(model.parameters())
    model(torch.ones(2, 4)).sum().backward()
    optimizer.step()
    path = tmp_path / "checkpoint.pt"
    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "step": 5}, path)
    state = sorted(f"optimizer.state.{i}.{k}" for i in (0, 1) for k in ("exp_avg", "exp_avg_sq", "step"))
    result = run("global", "--clip", "0.01", "--json", path)
    assert result.exit_code == 0, result.stderr
    data = json.loads(result.stdout)
    skipped = sorted(t["name"] for t in data["tensors"]
                     if t["skipped"] == "optimizer state, left out unless an include pattern names it")
    assert skipped == state
    assert any(w.startswith("6 optimizer variables (a training optimizer's moments") for w in data["warnings"])
    before, after = torch.load(path, weights_only=True), torch.load(tmp_path / "checkpoint.clipped.pt",
                                                                    weights_only=True)
    for key, value in before["optimizer"]["state"][0].items():
        assert torch.equal(after["optimizer"]["state"][0][key], value), key
    weights = torch.cat([v.double().reshape(-1) for v in after["model"].values()])
    assert math.isclose(float(weights.norm()), 0.01, rel_tol=1e-6)
    named = run("global", "--clip", "0.01", "--include", "*", "--json", "-o", tmp_path / "all.pt", path)
    assert named.exit_code == 0, named.stderr
    assert not any(t["skipped"] for t in json.loads(named.stdout)["tensors"])
