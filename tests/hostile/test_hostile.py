"""Hostile and damaged files (issue 11): one clean error or a right answer, never a crash, a hang,
a write outside the output, or memory beyond what the file really holds."""

from __future__ import annotations

import contextlib
import io
import json
import os
import signal
import struct
import subprocess
import sys
import zipfile
from pathlib import Path

import h5py
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import support
from support import gguf_helpers
from support import torch_helpers
from support.formats_helpers import safetensors_bytes
from tclip.core.modes import NormClip
from tclip.errors import NonFiniteError, TclipError
from tclip.formats.hdf5 import probe as h5probe
from tclip.formats import open_reader
from tclip.work.clip import clip_file, report_file
from tclip.work.options import ClipOptions
from tclip.work.selection import Selection

RNG = np.random.default_rng(44)


@contextlib.contextmanager
def time_limit(seconds: int):
    def expire(signum, frame):
        raise TimeoutError(f"took more than {seconds} s")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def valid_files(folder: Path) -> dict[str, bytes]:
    tensors = {"layers.0.w": (RNG.standard_normal((16, 8)) * 3).astype(np.float32),
               "layers.0.b": RNG.standard_normal(8).astype(np.float16), "step": np.array([3], np.int64)}
    out = {}
    out["safetensors"] = safetensors_bytes(tensors, metadata={"format": "pt"})
    buffer = io.BytesIO()
    np.savez(buffer, **tensors)
    out["npz"] = buffer.getvalue()
    buffer = io.BytesIO()
    np.savez_compressed(buffer, **tensors)
    out["npz-deflated"] = buffer.getvalue()
    buffer = io.BytesIO()
    np.save(buffer, tensors["layers.0.w"])
    out["npy"] = buffer.getvalue()
    with h5py.File(folder / "seed.h5", "w") as f:
        f.attrs["note"] = "seed"
        f.create_dataset("layers/0/w", data=tensors["layers.0.w"], chunks=(4, 8), compression="gzip")
        f.create_dataset("layers/0/b", data=tensors["layers.0.b"])
        f.create_dataset("vocab", data=np.array([b"a", b"b"]))
    out["h5"] = (folder / "seed.h5").read_bytes()
    out["pt"] = torch_helpers.save_arrays(folder / "seed.pt", tensors, values={"step": torch_helpers.num(3)}).read_bytes()
    out["pt-torch"] = (TORCH_FIXTURES / "views.pt").read_bytes()  # torch's own layout, views, tied storages
    # CRC-32s off (every CRC 0, as set_crc32_options(False) writes): damage reaches the pickle unchecked
    out["pt-crc-off"] = torch_helpers.save_arrays(folder / "nocrc.pt", tensors, crc32=False,
                                                  values={"step": torch_helpers.num(3)}).read_bytes()
    out["pt-legacy"] = (TORCH_FIXTURES / "legacy_state_dict.pt").read_bytes()
    for kind, order in (("gguf", "<"), ("gguf-be", ">")):  # quantized blocks, metadata arrays, both byte orders
        blocks = {8: gguf_helpers.random_blocks(8, 16, RNG, d=0.02), 12: gguf_helpers.random_blocks(12, 2, RNG)}
        if order == ">":
            blocks = {t: gguf_helpers.swap_block_fields(raw, t) for t, raw in blocks.items()}
        out[kind] = gguf_helpers.gguf_bytes(gguf_helpers.GgufSpec(order=order, metadata=[
            ("general.architecture", gguf_helpers.STRING, "llama"),
            ("tokenizer.ggml.tokens", gguf_helpers.ARRAY, gguf_helpers.Array(gguf_helpers.STRING, ["a", "bc"] * 8))],
            tensors=[gguf_helpers.Tensor("blk.0.attn_q.weight", (2, 256), 8, blocks[8]),
                     gguf_helpers.Tensor("blk.0.ffn_down.weight", (2, 256), 12, blocks[12]),
                     gguf_helpers.Tensor("output_norm.weight", (8,), 0, np.ones(8, order + "f4").tobytes())]))
    return out


TORCH_FIXTURES = support.FIXTURES / "torch"
SUFFIX = {"safetensors": ".safetensors", "npz": ".npz", "npz-deflated": ".npz", "npy": ".npy", "h5": ".h5",
          "pt": ".pt", "pt-torch": ".pt", "pt-crc-off": ".pt", "pt-legacy": ".pt", "gguf": ".gguf", "gguf-be": ".gguf"}


@st.composite
def mutations(draw, size: int):
    kind = draw(st.sampled_from(["flip", "truncate", "overwrite", "header"]))
    if kind == "flip":
        return kind, draw(st.lists(st.tuples(st.integers(0, size - 1), st.integers(0, 7)), min_size=1, max_size=8))
    if kind == "truncate":
        return kind, draw(st.integers(0, size - 1))
    if kind == "overwrite":
        return kind, (draw(st.integers(0, size - 1)), draw(st.binary(min_size=1, max_size=16)))
    # header: bytes near the start (headers, zip/HDF5 structures) get random values
    return kind, draw(st.lists(st.tuples(st.integers(0, min(size, 600) - 1), st.integers(0, 255)), min_size=1,
                               max_size=6))


def mutate(data: bytes, mutation) -> bytes:
    kind, spec = mutation
    out = bytearray(data)
    if kind == "flip":
        for position, bit in spec:
            out[position] ^= 1 << bit
    elif kind == "truncate":
        del out[spec:]
    elif kind == "overwrite":
        position, chunk = spec
        out[position:position + len(chunk)] = chunk
    else:
        for position, value in spec:
            out[position] = value
    return bytes(out)


@pytest.fixture(scope="module")
def seeds(tmp_path_factory):
    return valid_files(tmp_path_factory.mktemp("seeds"))


@pytest.mark.slow  # hypothesis over every format: minutes for HDF5
@pytest.mark.parametrize("kind", list(SUFFIX))
@settings(max_examples=int(os.environ.get("TCLIP_FUZZ_EXAMPLES", "25")), deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(data=st.data())
def test_fuzzed_files_give_a_result_or_one_clean_error(kind, seeds, tmp_path_factory, data):
    seed = seeds[kind]
    mutation = data.draw(mutations(len(seed)))
    folder = tmp_path_factory.mktemp("fuzz")
    path = folder / f"f{SUFFIX[kind]}"
    payload = mutate(seed, mutation)
    path.write_bytes(payload)
    out = folder / f"out{SUFFIX[kind]}"
    with time_limit(60):
        for work in (lambda: report_file(path, axes=(1,), moments=True),
                     lambda: clip_file(path, NormClip(1.0, axes=(1,)), ClipOptions(output=out, nonfinite="propagate")),
                     lambda: clip_file(path, NormClip(1.0), ClipOptions(output=folder / "out.safetensors",
                                                                        nonfinite="propagate",
                                                                        drop_nonnumeric=True))):
            try:
                work()
            except TclipError:
                pass
    assert path.read_bytes() == payload  # the input untouched
    assert {p.name for p in folder.iterdir()} <= {path.name, out.name, "out.safetensors"}  # nothing else written


def test_probe_crash_is_one_error(tmp_path, monkeypatch):
    path = tmp_path / "g.h5"
    with h5py.File(path, "w") as f:
        f["w"] = np.ones(3)
    crash = tmp_path / "crash.sh"
    crash.write_text("#!/bin/sh\nkill -SEGV $$\n")
    crash.chmod(0o755)
    monkeypatch.setattr(sys, "executable", str(crash))
    with pytest.raises(TclipError, match=r"the HDF5 library crashed \(SIGSEGV\) reading the file's structure"):
        open_reader(path)


def test_fill_value_dataset_of_many_chunks_is_bounded(tmp_path):
    path = tmp_path / "fill.h5"
    with h5py.File(path, "w") as f:
        f.create_dataset("sparse", shape=(1 << 24,), chunks=(1,), dtype="f4", fillvalue=0.5)
    with time_limit(120):
        report = report_file(path)
    assert report.tensors[0].norm == pytest.approx(0.5 * 2 ** 12)


def test_dataset_claiming_far_more_than_the_file_holds_is_refused(tmp_path):
    path = tmp_path / "bomb.h5"
    with h5py.File(path, "w") as f:
        f.create_dataset("huge", shape=(1 << 40, 1 << 20), chunks=(1, 1024), dtype="f4")
        f["ok"] = np.ones(3, np.float32)
    report = report_file(path)
    entry = {t.name: t for t in report.tensors}["huge"]
    assert entry.norm is None and "refused as a decompression bomb" in entry.skipped
    with pytest.raises(TclipError, match="decompression bomb"):
        clip_file(path, NormClip(1.0), ClipOptions(dry_run=True))


def test_huge_attribute_is_described_not_read(tmp_path):
    path = tmp_path / "attr.h5"
    with h5py.File(path, "w", libver="latest") as f:  # dense attribute storage: no 64 KiB limit
        f["w"] = np.ones(3)
        f.attrs["big"] = np.zeros(1 << 18)
        f.attrs["small"] = np.arange(3)
    with time_limit(60):
        info = open_reader(path)
    assert info.metadata["big"] == "<262144 attribute of float64, not shown>"
    assert info.metadata["small"] == [0, 1, 2]
    info.close()


def _in_memory_limit(args: list[str], limit_mb: int = 1500) -> subprocess.CompletedProcess:
    command = f"ulimit -v {limit_mb * 1024}; exec {sys.executable} -m tclip " + " ".join(map(str, args))
    return subprocess.run(["bash", "-c", command], capture_output=True, text=True, timeout=300)


def test_empty_tensor_with_a_huge_dimension_costs_nothing(tmp_path):
    path = tmp_path / "e.safetensors"
    header = json.dumps({"e": {"dtype": "F32", "shape": [268435456, 0], "data_offsets": [0, 0]}}).encode()
    path.write_bytes(struct.pack("<Q", len(header)) + header)
    result = _in_memory_limit(["norm", "--clip", "1", "--axes", "1", "--dry-run", path])
    assert result.returncode == 0, result.stderr


@pytest.mark.slow  # a header of many tensors, read whole
def test_many_tensors_in_a_big_header(tmp_path):
    count = 100_000
    header = {f"t{i}": {"dtype": "F32", "shape": [1], "data_offsets": [4 * i, 4 * i + 4]} for i in range(count)}
    text = json.dumps(header).encode()
    path = tmp_path / "many.safetensors"
    path.write_bytes(struct.pack("<Q", len(text)) + text + np.ones(count, np.float32).tobytes())
    result = _in_memory_limit(["info", "--json", path], limit_mb=2000)
    assert result.returncode == 0, result.stderr
    assert len(json.loads(result.stdout)["tensors"]) == count


# ------------------------------------------------------------------ exceptions of other libraries


def npy_with_header(text: str) -> bytes:
    raw = text.encode("latin-1")
    raw += b" " * (-(len(raw) + 11) % 64) + b"\n"
    return b"\x93NUMPY\x01\x00" + struct.pack("<H", len(raw)) + raw


CASES = {
    "unbalanced npy header": (".npy", lambda: npy_with_header("{'descr': '<f4', 'fortran_order': False, 'shape': (3,")),
    "zero itemsize": (".npy", lambda: npy_with_header("{'descr': '|V0', 'fortran_order': False, 'shape': (3,), }")),
    "2**64 dimension": (".npy", lambda: npy_with_header(f"{{'descr': '<f4', 'fortran_order': False, "
                                                         f"'shape': ({2 ** 64},), }}")),
    "nested JSON": (".safetensors", lambda: struct.pack("<Q", 40002) + b"[" * 20001 + b"]" * 20001),
    "lone surrogate key": (".safetensors", lambda: _st_raw('{"\\ud800": {"dtype": "F32", "shape": [1], '
                                                             '"data_offsets": [0, 4]}}', b"\0" * 4)),
    "lone surrogate metadata": (".safetensors", lambda: _st_raw('{"__metadata__": {"a": "\\udfff"}, "w": {"dtype": '
                                                                  '"F32", "shape": [1], "data_offsets": [0, 4]}}',
                                                                  b"\0" * 4)),
    "corrupt deflate": (".npz", lambda: _corrupt_deflate()),
    "empty member name": (".npz", lambda: _zip({"": b"x"})),
    "unknown compression": (".npz", lambda: _zip_method(99)),
}


def _st_raw(text: str, data: bytes) -> bytes:
    raw = text.encode()
    return struct.pack("<Q", len(raw)) + raw + data


def _zip(members: dict[str, bytes]) -> bytes:
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as z:
        for name, data in members.items():
            z.writestr(zipfile.ZipInfo(name) if name else zipfile.ZipInfo("x"), data)
    data = buffer.getvalue()
    return data.replace(b"x", b"", 0) if "" in members else data


def _zip_method(method: int) -> bytes:
    buffer = io.BytesIO()
    np.savez(buffer, w=np.ones(3))
    data = bytearray(buffer.getvalue())
    for signature, offset in ((b"PK\x03\x04", 8), (b"PK\x01\x02", 10)):
        position = data.find(signature)
        data[position + offset:position + offset + 2] = struct.pack("<H", method)
    return bytes(data)


def _corrupt_deflate() -> bytes:
    buffer = io.BytesIO()
    np.savez_compressed(buffer, w=RNG.standard_normal(5000))
    data = bytearray(buffer.getvalue())
    for i in range(200, 600, 7):
        data[i] ^= 0x55
    return bytes(data)


@pytest.mark.parametrize("name", list(CASES))
def test_other_libraries_exceptions_become_one_clean_error(tmp_path, name):
    suffix, make = CASES[name]
    path = tmp_path / f"f{suffix}"
    path.write_bytes(make())
    with pytest.raises(TclipError) as info:
        report_file(path)
    assert str(info.value).startswith(str(path))


def test_nan_tensor_followed_by_an_unselected_one_is_the_nan_refusal(tmp_path):
    path = tmp_path / "g.safetensors"
    path.write_bytes(safetensors_bytes({"a": np.array([np.nan, 1], np.float32), "b": np.ones(2, np.float32)}))
    with pytest.raises(NonFiniteError, match="NaN/Inf values in a"):
        clip_file(path, NormClip(1.0), ClipOptions(selection=Selection(include=("a",))))
    assert sorted(os.listdir(tmp_path)) == ["g.safetensors"]


@pytest.mark.parametrize("deflated", [False, True])
def test_full_disk_during_an_npz_rewrite_is_one_line(tmp_path, deflated):
    path = tmp_path / "g.npz"
    (np.savez_compressed if deflated else np.savez)(path, w=RNG.standard_normal((64, 64)) * 10)
    before = path.read_bytes()
    code = (
        "import errno, os, sys, zipfile\n"
        "real_pwrite, real_write = os.pwrite, zipfile._ZipWriteFile.write\n"
        "def full(*a, **k): raise OSError(errno.ENOSPC, 'No space left on device')\n"
        "os.pwrite = full\nzipfile._ZipWriteFile.write = full\n"
        f"sys.argv = ['tclip', 'norm', '--clip', '1', '--in-place', {str(path)!r}]\n"
        "from tclip.cli.entry import main\nmain()\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 1
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("Error: ") and "No space left on device" in lines[0], lines
    assert f"cannot write {path}" in lines[0]  # where it could not write
    assert path.read_bytes() == before
    assert sorted(os.listdir(tmp_path)) == ["g.npz"]
