"""Hardening, round 3 (issue 21): no code from the current folder, no write through a planted link,
no input replaced, no output shared by two inputs, no tensor sharing bytes with another."""

from __future__ import annotations

import io
import json
import os
import shutil
import struct
import subprocess
import zipfile
from pathlib import Path

import h5py
import numpy as np
import pytest

from support.cli import run
from support.formats_helpers import safetensors_bytes
from tclip.core.modes import GlobalNormClip, NormClip
from tclip.errors import FormatError, TclipError
from tclip.formats.hdf5 import probe as h5probe
from tclip.formats import atomic, open_reader
from tclip.work.clip import clip_file
from tclip.work.options import ClipOptions
from tclip.formats.sharded import TensorSet
from tclip.work.clip import clip_set
from tclip.work import clip as tensorset  # where clipping a set runs its tasks

RNG = np.random.default_rng(21)


def snapshot(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*"))
            if p.is_file() and not p.is_symlink()}


def grads(path: Path, scale: float = 3.0) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    np.savez(path, w=(RNG.standard_normal((8, 4)) * scale).astype(np.float32), b=np.ones(4, np.float32))
    return path


# ------------------------------------------------------------------ 1. no code from the current folder


CRASH_FILTER = 40123  # an unregistered HDF5 filter id; the plugin below crashes when HDF5 applies it
CRASH_PLUGIN = r"""
#include <stddef.h>
typedef struct {
    int version; int id; unsigned encoder_present; unsigned decoder_present; const char *name;
    void *can_apply; void *set_local;
    size_t (*filter)(unsigned, size_t, const unsigned *, size_t, size_t *, void **);
} filter_class;
static size_t crash(unsigned flags, size_t n, const unsigned *v, size_t nbytes, size_t *size, void **buf) {
    *(volatile int *)0 = 0;
    return 0;
}
static const filter_class CLASS = {1, FILTER, 1, 1, "crash", NULL, NULL, crash};
int H5PLget_plugin_type(void) { return 0; }
const void *H5PLget_plugin_info(void) { return &CLASS; }
"""


def crashing_file(folder: Path, monkeypatch) -> Path:
    """A file whose walk crashes the HDF5 library (SIGSEGV), through a filter plugin
    found on HDF5_PLUGIN_PATH: a deterministic stand-in for a crafted file that does."""
    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        pytest.skip("no C compiler to build the crashing HDF5 filter plugin")
    plugins = folder / "plugins"
    plugins.mkdir()
    (plugins / "crash.c").write_text(CRASH_PLUGIN.replace("FILTER", str(CRASH_FILTER)))
    subprocess.run([compiler, "-shared", "-fPIC", "-o", str(plugins / "libcrash.so"), str(plugins / "crash.c")],
                   check=True, capture_output=True)
    path = folder / "crash.h5"
    with h5py.File(path, "w") as f:
        dataset = f.create_dataset("w", shape=(4,), dtype="f4", chunks=(4,), compression=CRASH_FILTER,
                                   allow_unknown_filter=True)
        dataset.id.write_direct_chunk((0,), np.ones(4, np.float32).tobytes())
    monkeypatch.setenv("HDF5_PLUGIN_PATH", str(plugins))
    return path


def test_the_structure_check_runs_no_module_of_the_current_folder(tmp_path, monkeypatch):
    planted = tmp_path / "planted"
    planted.mkdir()
    marker = tmp_path / "planted-code-ran"
    for module in ("h5py", "numpy", "tclip"):  # each would end the check as passed
        (planted / f"{module}.py").write_text(f"import os\nopen({str(marker)!r}, 'w').close()\nos._exit(0)\n")
    crash = crashing_file(tmp_path, monkeypatch)
    good = planted / "m.h5"
    with h5py.File(good, "w") as f:
        f["w"] = np.full(4, 2.0, np.float32)
    monkeypatch.chdir(planted)
    monkeypatch.setenv("PYTHONPATH", str(planted))
    with pytest.raises(FormatError, match=r"the HDF5 library crashed \(SIGSEGV\)"):
        with open_reader(crash) as reader:
            reader.read("w")
    result = run("report", "--json", "m.h5")
    assert result.exit_code == 0, result.stderr
    assert json.loads(result.stdout)["global_norm"] == 4.0
    assert not marker.exists()


def test_the_structure_check_is_started_isolated():
    command = h5probe.child_command("m.h5")
    assert "-I" in command[1:command.index("-c")]  # no current folder, PYTHONPATH or user site
    assert command[-1] == "m.h5"


# ------------------------------------------------------------------ 2. no write through a planted link


@pytest.fixture
def victim(tmp_path):
    path = tmp_path / "elsewhere" / "victim.txt"
    path.parent.mkdir()
    path.write_bytes(b"precious\n")
    return path


def plant(path: Path, victim: Path, how: str) -> None:
    if how == "symlink":
        path.symlink_to(victim)
    else:
        os.link(victim, path)


def sharded(folder: Path, shards: int = 3) -> Path:
    folder.mkdir(parents=True)
    weight_map = {}
    for s in range(shards):
        shard = f"model-{s + 1}-of-{shards}.safetensors"
        tensors = {f"layer{s}.w": (RNG.standard_normal((6, 5)) * (s + 2)).astype(np.float32)}
        (folder / shard).write_bytes(safetensors_bytes(tensors))
        weight_map.update({name: shard for name in tensors})
    index = folder / "model.safetensors.index.json"
    index.write_text(json.dumps({"metadata": {"total_size": 1}, "weight_map": weight_map}))
    return index


@pytest.mark.parametrize("how", ["symlink", "hardlink"])
def test_a_link_planted_at_a_commit_marker_is_never_written_through(tmp_path, monkeypatch, victim, how):
    index = sharded(tmp_path / "ckpt")
    real, calls = tensorset.rewrite_task, []

    def crash_on_second(*args, **kwargs):
        calls.append(args[0])
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    monkeypatch.setattr(tensorset, "rewrite_task", crash_on_second)
    with pytest.raises(KeyboardInterrupt):
        clip_set(TensorSet(str(index), [], index), GlobalNormClip(1.0), ClipOptions(in_place=True, threads=1))
    monkeypatch.undo()
    for shard in index.parent.glob("*.safetensors"):  # the markers the resumed run writes
        plant(shard.with_name(f".{shard.name}.tclip-commit"), victim, how)
    result = run("global", "--clip", "1", "--in-place", index)
    assert result.exit_code == 0, result.stderr
    assert victim.read_bytes() == b"precious\n"
    assert "tclip_in_progress" not in json.loads(index.read_text())["metadata"]  # finished


def test_a_link_planted_at_the_journal_is_never_written_through(tmp_path, victim):
    index = sharded(tmp_path / "ckpt")
    journal = index.with_name(index.name + ".tclip-journal")
    journal.symlink_to(victim)
    result = run("global", "--clip", "1", "--in-place", index)
    assert result.exit_code == 1 and "journal" in result.stderr
    assert victim.read_bytes() == b"precious\n"
    journal.unlink()
    gone = tmp_path / "elsewhere" / "not-yet"
    journal.symlink_to(gone)  # dangling: following it would create a file there
    result = run("global", "--clip", "1", "--in-place", index)
    assert result.exit_code == 0, result.stderr
    assert not gone.exists() and not os.path.lexists(journal)


def test_a_link_planted_at_the_temporary_name_is_never_followed(tmp_path, monkeypatch, victim):
    source = grads(tmp_path / "g.npz")
    monkeypatch.setattr(atomic, "_token", lambda: "0badc0de")
    temp = tmp_path / f".g.clipped.npz.{atomic._HOST}.{os.getpid()}.0badc0de.tclip-tmp"
    temp.symlink_to(victim)
    with pytest.raises(TclipError, match="cannot write to this folder"):
        clip_file(source, NormClip(1.0))
    assert victim.read_bytes() == b"precious\n"
    assert not (tmp_path / "g.clipped.npz").exists()


def _inputs(folder: Path) -> dict[str, Path]:
    arrays = {"w": (RNG.standard_normal((8, 4)) * 3).astype(np.float32), "b": np.ones(4, np.float32)}
    out = {}
    np.savez(folder / "stored.npz", **arrays)
    np.savez_compressed(folder / "deflated.npz", **arrays)
    np.save(folder / "w.npy", arrays["w"])
    (folder / "m.safetensors").write_bytes(safetensors_bytes(arrays))
    with h5py.File(folder / "m.h5", "w") as f:
        f["w"] = arrays["w"]
        f.create_dataset("c", data=arrays["w"], chunks=(2, 4), compression="gzip")
    for path in folder.iterdir():
        out[path.name] = path
    return out


@pytest.mark.parametrize("how", ["symlink", "hardlink"])
@pytest.mark.parametrize("case", ["stored.npz", "deflated.npz", "w.npy", "m.safetensors", "m.h5",
                                  "stored.npz -> .h5", "index", "journal"])
def test_a_temporary_file_replaced_while_writing_is_never_written_through(tmp_path, monkeypatch, victim, how,
                                                                          case):
    folder = tmp_path / "in"
    folder.mkdir()
    inputs = _inputs(folder)
    real = atomic.AtomicOutput.__init__

    def replaced_after_creation(self, *args, **kwargs):
        real(self, *args, **kwargs)
        os.unlink(self.temp)  # someone who can write to the folder swaps the name
        plant(self.temp, victim, how)

    monkeypatch.setattr(atomic.AtomicOutput, "__init__", replaced_after_creation)
    with pytest.raises(TclipError, match="was replaced while tclip wrote it"):
        if case == "index":
            index = sharded(tmp_path / "ckpt")
            (tmp_path / "out").mkdir()
            clip_set(TensorSet(str(index), [], index), GlobalNormClip(1.0), ClipOptions(out_dir=tmp_path / "out"))
        elif case == "journal":  # the first file an in-place run writes
            index = sharded(tmp_path / "ckpt")
            clip_set(TensorSet(str(index), [], index), GlobalNormClip(1.0), ClipOptions(in_place=True))
        elif case.endswith("-> .h5"):
            clip_file(inputs[case.split()[0]], NormClip(1.0), ClipOptions(output=folder / "out.h5"))
        else:
            clip_file(inputs[case], NormClip(1.0))
    assert victim.read_bytes() == b"precious\n"
    assert os.stat(victim).st_mode & 0o777 == 0o644 & ~_umask()  # not even its mode changed
    assert not [p for p in folder.iterdir() if p.name.startswith(".") or "clipped" in p.name or p.name == "out.h5"]


def _umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


# ------------------------------------------------------------------ 3, 4. no input replaced, no output shared


@pytest.mark.parametrize("force", [[], ["--force"]])
def test_across_files_into_the_inputs_own_folder_is_refused(tmp_path, force):
    a = tmp_path / "a"
    g, h = grads(a / "g.npz"), grads(a / "h.npz")
    before = snapshot(tmp_path)
    result = run("global", "--clip", "1", "--across-files", "--out-dir", a, *force, g, h)
    assert result.exit_code == 1, result.output
    assert result.stderr == f"Error: {g}: the output {g} would replace the input {g}; nothing was written " \
                            "(--in-place replaces inputs)\n"
    assert snapshot(tmp_path) == before


def sub_sharded(folder: Path) -> Path:
    """An index naming a shard in its folder and one in a subfolder, both a.safetensors."""
    (folder / "sub").mkdir(parents=True)
    (folder / "a.safetensors").write_bytes(safetensors_bytes({"x": np.full(4, 3.0, np.float32)}))
    (folder / "sub" / "a.safetensors").write_bytes(safetensors_bytes({"y": np.full(4, 4.0, np.float32)}))
    index = folder / "model.safetensors.index.json"
    index.write_text(json.dumps({"weight_map": {"x": "a.safetensors", "y": "sub/a.safetensors"}}))
    return index


@pytest.mark.parametrize("force", [[], ["--force"]])
def test_an_out_dir_holding_a_shard_is_refused(tmp_path, force):
    index = sub_sharded(tmp_path / "ck")
    before = snapshot(tmp_path)
    result = run("global", "--clip", "1", "--out-dir", tmp_path / "ck" / "sub", *force, index)
    assert result.exit_code == 1, result.output
    shard = tmp_path / "ck" / "a.safetensors"
    assert result.stderr == (f"Error: {shard}: the output {tmp_path / 'ck' / 'sub' / 'a.safetensors'} would replace "
                             f"the input {tmp_path / 'ck' / 'sub' / 'a.safetensors'}; nothing was written "
                             "(--in-place replaces inputs)\n")
    assert snapshot(tmp_path) == before


@pytest.mark.parametrize("force", [[], ["--force"]])
def test_an_output_that_is_the_input_through_a_symlink_is_refused(tmp_path, force):
    # (another hard link of the input may be an output: tests/hostile/test_output_links.py)
    g = grads(tmp_path / "a" / "g.npz")
    (tmp_path / "link").symlink_to(tmp_path / "a")
    before = snapshot(tmp_path)
    for how in (["--out-dir", tmp_path / "link"], ["--out-dir", tmp_path / "a"]):
        result = run("norm", "--clip", "1", *how, *force, g)
        assert result.exit_code == 1, result.output
        assert result.stderr.startswith(f"Error: {g}: the output ") and "would replace the input" in result.stderr
        assert snapshot(tmp_path) == before
    with pytest.raises(TclipError, match="would replace the input"):
        clip_file(g, NormClip(1.0), ClipOptions(output=tmp_path / "link" / "g.npz", overwrite=True))


@pytest.mark.parametrize("across", [[], ["--across-files"]])
@pytest.mark.parametrize("force", [[], ["--force"]])
def test_two_inputs_of_one_name_into_one_out_dir_are_refused(tmp_path, across, force):
    first, second = grads(tmp_path / "a" / "g.npz"), grads(tmp_path / "b" / "g.npz", scale=5.0)
    before = snapshot(tmp_path)
    result = run("norm", "--clip", "1", "--out-dir", tmp_path / "out", *across, *force, first, second)
    assert result.exit_code == 1, result.output
    assert result.stderr == (f"Error: {tmp_path / 'out' / 'g.npz'}: {first} and {second} would both be written to "
                             "this file; nothing was written (clip them into separate folders)\n")
    assert snapshot(tmp_path) == before
    assert not (tmp_path / "out").exists()  # the folder the run made is gone again


def test_an_output_of_one_input_that_is_another_input_is_refused(tmp_path):
    g = grads(tmp_path / "g.npz")
    clipped = grads(tmp_path / "g.clipped.npz")  # last run's output, given again (a shell glob)
    before = snapshot(tmp_path)
    result = run("norm", "--clip", "1", "--force", g, clipped)
    assert result.exit_code == 1 and "would replace the input" in result.stderr
    assert snapshot(tmp_path) == before


# ------------------------------------------------------------------ 5. tensors sharing bytes


def _central_entries(data: bytes) -> list[int]:
    end = data.rfind(b"PK\x05\x06")
    count, _, start = struct.unpack("<HLL", data[end + 10:end + 20])
    out, position = [], start
    for _ in range(count):
        out.append(position)
        lengths = struct.unpack("<HHH", data[position + 28:position + 34])
        position += 46 + sum(lengths)
    return out


def test_npz_members_sharing_a_local_header_are_refused(tmp_path):
    buffer = io.BytesIO()
    np.savez(buffer, a=np.arange(8, dtype=np.float32), b=np.ones(8, np.float32))
    data = bytearray(buffer.getvalue())
    entries = _central_entries(data)
    struct.pack_into("<L", data, entries[1] + 42, 0)  # b's entry names a's local header
    path = tmp_path / "shared.npz"
    path.write_bytes(bytes(data))
    with pytest.raises(FormatError, match="tensor 'a' and tensor 'b' share bytes of the archive"):
        open_reader(path)


def test_npz_member_inside_another_members_data_is_refused(tmp_path):
    b = np.full(8, 7.0, np.float32)
    alone = io.BytesIO()
    np.savez(alone, b=b)
    record = alone.getvalue()[:zipfile.ZipFile(alone).start_dir]  # b's local header and data
    carrier = np.frombuffer(record + b"\0" * (-len(record) % 4), np.uint8)
    buffer = io.BytesIO()
    np.savez(buffer, a=carrier, b=b)
    data = bytearray(buffer.getvalue())
    entries = _central_entries(data)
    inside = data.find(record[:64], 1)  # b's record as a's data
    struct.pack_into("<L", data, entries[1] + 42, inside)
    path = tmp_path / "nested.npz"
    path.write_bytes(bytes(data))
    with zipfile.ZipFile(path) as z:  # what the archive says: b's bytes are a's
        assert z.getinfo("b.npy").header_offset == inside
    with pytest.raises(FormatError, match="tensor 'a' and tensor 'b' share bytes of the archive"):
        open_reader(path)
    before = path.read_bytes()
    result = run("norm", "--clip", "1", "--exclude", "b", path)
    assert result.exit_code == 1 and "share bytes" in result.stderr
    assert path.read_bytes() == before and not (tmp_path / "nested.clipped.npz").exists()


def _patched_h5(tmp_path: Path, retarget) -> Path:
    """A v0 (no checksums) HDF5 file with one address in a layout message replaced."""
    path = tmp_path / "h.h5"
    with h5py.File(path, "w", libver="earliest") as f:
        f["a"] = np.arange(16, dtype=np.float32)
        f["b"] = np.ones(16, np.float32)
        f.create_dataset("c", data=np.ones((8, 8), np.float32), chunks=(2, 8))
        f["names"] = np.array([b"x" * 16] * 4)
        chunks = []
        f["c"].id.chunk_iter(lambda chunk: chunks.append(chunk.byte_offset))
        where = {"a": f["a"].id.get_offset(), "b": f["b"].id.get_offset(), "c": chunks[0],
                 "names": f["names"].id.get_offset()}
    old, new = retarget(where)
    data = bytearray(path.read_bytes())
    assert data.count(struct.pack("<Q", where[old])) == 1
    at = data.find(struct.pack("<Q", where[old]))
    data[at:at + 8] = struct.pack("<Q", new if isinstance(new, int) else where[new])
    path.write_bytes(bytes(data))
    return path


@pytest.mark.parametrize("retarget, message", [
    (lambda w: ("b", "a"), "tensor 'a' and tensor 'b' share bytes of the file"),
    (lambda w: ("c", "a"), "tensor 'a' and tensor 'c' share bytes of the file"),  # a chunk on a contiguous block
    (lambda w: ("b", "c"), "tensor 'b' and tensor 'c' share bytes of the file"),
    (lambda w: ("names", "b"), "dataset 'names' and tensor 'b' share bytes of the file"),
    (lambda w: ("b", 40), "the file's superblock and tensor 'b' share bytes of the file"),
], ids=["contiguous", "chunk-on-contiguous", "contiguous-on-chunk", "string-dataset", "superblock"])
def test_hdf5_datasets_sharing_bytes_are_refused(tmp_path, retarget, message):
    path = _patched_h5(tmp_path, retarget)
    with pytest.raises(FormatError, match=message):
        open_reader(path)
    before = path.read_bytes()
    result = run("norm", "--clip", "1", path)
    assert result.exit_code == 1 and message in result.stderr
    assert path.read_bytes() == before and not (tmp_path / "h.clipped.h5").exists()


def test_hdf5_chunks_sharing_bytes_are_refused(tmp_path):
    path = tmp_path / "c.h5"
    with h5py.File(path, "w", libver="earliest") as f:
        f.create_dataset("c", data=np.arange(64, dtype=np.float32).reshape(8, 8), chunks=(2, 8))
        chunks = []
        f["c"].id.chunk_iter(lambda chunk: chunks.append(chunk.byte_offset))
    data = bytearray(path.read_bytes())
    at = data.find(struct.pack("<Q", chunks[1]))
    data[at:at + 8] = struct.pack("<Q", chunks[0] + 8)  # the second chunk starts inside the first
    path.write_bytes(bytes(data))
    with pytest.raises(FormatError, match="two chunks of tensor 'c' share bytes of the file"):
        open_reader(path)
