"""The HDF5 library works on untrusted files in a child process (issue 21.13): a crash or a hang of
the library while decoding a chunk, writing one or walking the structure ends the child, never tclip,
and is one `Error:` line naming the file; h5py's own exceptions are errors, never internal errors."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import h5py
import numpy as np
import pytest

from tclip.errors import FormatError
from tclip.formats.hdf5 import probe as h5probe
from tclip.formats import TensorInfo, open_reader
from tclip.formats.hdf5 import Hdf5Reader
from tclip.work.clip import report_file

FILTER = 40125  # an unregistered filter id, served by the plugin below
# cd_values[0] says what the filter does: 1 crashes when it encodes (a write), 2 crashes when it
# decodes a chunk whose first byte is 0xEE, 3 loops forever there; otherwise it passes bytes as they are.
PLUGIN = r"""
#include <stddef.h>
typedef struct {
    int version; int id; unsigned encoder_present; unsigned decoder_present; const char *name;
    void *can_apply; void *set_local;
    size_t (*filter)(unsigned, size_t, const unsigned *, size_t, size_t *, void **);
} filter_class;
static size_t act(unsigned flags, size_t n, const unsigned *v, size_t nbytes, size_t *size, void **buf) {
    unsigned mode = n ? v[0] : 0;
    int decoding = (flags & 0x0100) != 0;
    unsigned char first = nbytes ? ((unsigned char *)*buf)[0] : 0;
    if (mode == 1 && !decoding) *(volatile int *)0 = 0;
    if (mode == 2 && decoding && first == 0xEE) *(volatile int *)0 = 0;
    if (mode == 3 && decoding && first == 0xEE) for (volatile int spin = 1; spin;) {}
    return nbytes;
}
static const filter_class CLASS = {1, FILTER, 1, 1, "tclip-test", NULL, NULL, act};
int H5PLget_plugin_type(void) { return 0; }
const void *H5PLget_plugin_info(void) { return &CLASS; }
"""

NAME = "model.layers.17.self_attn.k_proj.weight"


@pytest.fixture(scope="module")
def plugin_folder(tmp_path_factory):
    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        pytest.skip("no C compiler to build the test's HDF5 filter plugin")
    folder = tmp_path_factory.mktemp("plugins")
    (folder / "filter.c").write_text(PLUGIN.replace("FILTER", str(FILTER)))
    subprocess.run([compiler, "-shared", "-fPIC", "-o", str(folder / "libtclip_test_filter.so"),
                    str(folder / "filter.c")], check=True, capture_output=True)
    return folder


@pytest.fixture
def filtered(plugin_folder, tmp_path, monkeypatch):
    """make(mode): a file whose tensor's 8 chunks pass the test filter; chunk 5 starts with 0xEE."""
    monkeypatch.setenv("HDF5_PLUGIN_PATH", str(plugin_folder))

    def make(mode: int) -> Path:
        path = tmp_path / f"mode{mode}.h5"
        rows = np.full((8, 16), 3.0, np.float32)
        raw = rows.copy()
        raw.view(np.uint8).reshape(8, 64)[5, 0] = 0xEE
        with h5py.File(path, "w") as f:
            f.attrs["note"] = "a filter of the test's own"
            dataset = f.create_dataset(NAME, shape=rows.shape, dtype="f4", chunks=(1, 16), compression=FILTER,
                                       compression_opts=(mode,), allow_unknown_filter=True)
            for i in range(8):  # written as stored bytes: the filter never runs here
                dataset.id.write_direct_chunk((i, 0), raw[i].tobytes())
            f["model.norm.weight"] = np.ones(4, np.float32)
        return path

    return make


def tclip(*args: object, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tclip", *map(str, args)], capture_output=True, text=True,
                          cwd=cwd, timeout=300)


def one_error(result: subprocess.CompletedProcess, path: Path) -> str:
    assert result.returncode == 1, (result.returncode, result.stderr)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"Error: {path.name}: "), lines
    return lines[0]


def test_a_crash_decoding_a_later_chunk_ends_the_child_not_tclip(filtered):
    path = filtered(2)
    before = path.read_bytes()
    for command in (["report"], ["norm", "--clip", "1"], ["diff", path.name]):
        line = one_error(tclip(*command, path.name, cwd=path.parent), path)
        assert f"the HDF5 library crashed (SIGSEGV) reading tensor '{NAME}' in a separate process" in line
    assert path.read_bytes() == before
    assert sorted(p.name for p in path.parent.iterdir()) == [path.name]


def test_a_crash_writing_a_chunk_ends_the_child_not_tclip(filtered):
    path = filtered(1)
    before = path.read_bytes()
    result = tclip("report", "--json", path.name, cwd=path.parent)
    assert result.returncode == 0, result.stderr  # decoding works: only writing crashes
    line = one_error(tclip("norm", "--clip", "1", path.name, cwd=path.parent), path)
    # (HDF5 encodes a chunk when it leaves the chunk cache: as the output is finished, here)
    assert "the HDF5 library crashed (SIGSEGV) writing the output in a separate process" in line
    assert path.read_bytes() == before
    assert sorted(p.name for p in path.parent.iterdir()) == [path.name]  # no output, no temporary file


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


def test_a_hang_decoding_a_chunk_is_bounded(filtered, monkeypatch):
    path = filtered(3)
    monkeypatch.setattr(h5probe, "REQUEST_SECONDS", 2)
    with time_limit(60), pytest.raises(FormatError, match=f"reading tensor '{NAME}' took the HDF5 library more "
                                                          "than 2 s in a separate process; refused as malformed"):
        report_file(path)


def test_a_hang_walking_the_structure_is_bounded(tmp_path, monkeypatch):
    path = tmp_path / "g.h5"
    with h5py.File(path, "w") as f:
        f["w"] = np.ones(3, np.float32)
    sleeper = tmp_path / "sleep.sh"  # stands in for a child stuck in the library
    sleeper.write_text("#!/bin/sh\nexec sleep 600\n")
    sleeper.chmod(0o755)
    monkeypatch.setattr(sys, "executable", str(sleeper))
    monkeypatch.setattr(h5probe, "WALK_SECONDS", 1)
    with time_limit(60), pytest.raises(FormatError, match="reading the file's structure took the HDF5 library more than 1 s"):
        open_reader(path)


def test_the_main_process_never_opens_an_untrusted_file_with_hdf5(filtered, monkeypatch):
    path = filtered(0)
    with open_reader(path) as reader:
        assert isinstance(reader, Hdf5Reader) and reader.file is None  # h5py works in the child only
        assert float(np.linalg.norm(reader.read(NAME))) == pytest.approx(np.linalg.norm(np.full((8, 16), 3.0)),
                                                                          rel=1e-6)
        assert reader.read(NAME, (slice(5, 7), slice(0, 16))).shape == (2, 16)
        assert reader.read_flat(NAME, 3, 40).shape == (37,)
    monkeypatch.setenv("TCLIP_HDF5_PROBE", "0")  # files you trust: h5py in this process
    with open_reader(path) as reader:
        assert reader.file is not None


def test_a_dropped_reader_ends_its_child(filtered):
    reader = open_reader(filtered(0))
    process = reader._child.process
    del reader
    assert process.wait(timeout=60) == 0


def test_h5py_errors_in_this_process_are_format_errors(tmp_path, monkeypatch):
    path = tmp_path / "g.h5"
    with h5py.File(path, "w") as f:
        f.create_dataset("w", data=np.arange(64, dtype=np.float32), chunks=(8,), compression="gzip")
    monkeypatch.setenv("TCLIP_HDF5_PROBE", "0")
    with open_reader(path) as reader:
        def broken(*args, **kwargs):
            raise RuntimeError("Can't decrement id ref count (unable to close file)")

        monkeypatch.setattr(h5py.Dataset, "__getitem__", broken)
        with pytest.raises(FormatError, match="tensor 'w' cannot be read"):
            reader.read_flat("w", 0, 64)
        with pytest.raises(FormatError, match="tensor 'w' cannot be read"):
            reader.read("w")


def test_the_child_reads_what_tclip_reads(tmp_path):
    """Every way a tensor is stored, read through the child and in this process: the same bits."""
    path = tmp_path / "all.h5"
    rng = np.random.default_rng(3)
    with h5py.File(path, "w") as f:
        f["contiguous"] = rng.standard_normal((6, 5)).astype(np.float32)
        f.create_dataset("chunked", data=rng.standard_normal((9, 7)), chunks=(4, 3))
        f.create_dataset("compressed", data=rng.standard_normal((30, 4)).astype(np.float16), chunks=(7, 4),
                         compression="gzip", shuffle=True)
        sparse = f.create_dataset("sparse", shape=(300,), chunks=(3,), dtype="f4", fillvalue=0.5)
        sparse[10:13] = [1, 2, 3]
        f.create_dataset("big-endian", data=np.arange(12, dtype=">f8").reshape(3, 4))
        f["scalar"] = np.float32(2.5)
        f["empty"] = np.zeros((0, 3), np.float32)
        f["words"] = np.array([b"alpha", b"beta"])
        f["records"] = np.array([(1.0, 2)], dtype=[("x", "<f4"), ("n", "<i4")])
        f.create_dataset("text", data=["vlen", "strings"], dtype=h5py.string_dtype())
        f["extended"] = np.arange(3.0, dtype=np.longdouble)  # a type never read: fails a gate
        f["layers/dense/vars/0"] = np.ones(3, np.float32)  # Keras 3's layout: optimizer state flagged
        f["optimizer/vars/0"] = np.zeros(3, np.float32)
    with Hdf5Reader(path, isolated=True) as child, Hdf5Reader(path, isolated=False) as local:
        assert list(child.tensors) == list(local.tensors)
        assert child.tensors == local.tensors and child.metadata == local.metadata
        # every field, also those equality leaves out
        fields = [f.name for f in dataclasses.fields(TensorInfo) if f.name != "encoding"]
        assert [[getattr(t, k) for k in fields] for t in child.tensors.values()] == \
            [[getattr(t, k) for k in fields] for t in local.tensors.values()]
        assert child.tensors["optimizer/vars/0"].optimizer_state
        assert child.others == local.others
        assert [o.name for o in child.others if o.unreadable_type] == ["extended"]
        for name, info in local.tensors.items():
            assert child.read(name).tobytes() == local.read(name).tobytes(), name
            assert child.read_flat(name, 0, info.size).tobytes() == local.read_flat(name, 0, info.size).tobytes()
            assert list(child.blocks(name, 64)) == list(local.blocks(name, 64)), name
        for other in local.others:
            mine, theirs = child.other_values(other.name, 1 << 20), local.other_values(other.name, 1 << 20)
            assert mine.shape == theirs.shape and int(np.count_nonzero(mine != mine)) == 0
        words = child.other_values("words", 1 << 20)
        assert words.tolist() == [b"alpha", b"beta"]
        texts = child.other_values("text", 1 << 20)
        assert texts.dtype == object and texts[0] != texts[1]


# ------------------------------------------------------------------ a child started early by the command line


def small_h5(path: Path, value: float) -> Path:
    with h5py.File(path, "w") as f:
        f["model/dense/kernel"] = np.full((3, 4), value, np.float32)
    return path


def test_a_child_started_early_is_adopted_by_the_reader(tmp_path, monkeypatch):
    from tclip.formats.hdf5 import child as children

    path = small_h5(tmp_path / "m.h5", 0.5)
    children.prestart(["report", "--json", str(path)])
    assert len(children._SPARES) == 1
    # the reader must not start a child of its own: it adopts the one started early
    monkeypatch.setattr(h5probe.subprocess, "Popen", lambda *a, **k: pytest.fail("a second child was started"))
    with open_reader(path) as reader:
        assert reader.read("model/dense/kernel").tolist() == np.full((3, 4), 0.5, np.float32).tolist()
    assert children._SPARES == {}


def test_a_child_started_on_a_file_replaced_since_is_not_adopted(tmp_path):
    from tclip.formats.hdf5 import child as children

    path = small_h5(tmp_path / "m.h5", 0.5)
    children.prestart([str(path)])
    (spare, _), = children._SPARES.values()
    small_h5(tmp_path / "new.h5", 2.0).replace(path)  # another file under the name
    with open_reader(path) as reader:
        assert float(reader.read("model/dense/kernel")[0, 0]) == 2.0
    assert children._SPARES == {} and spare.poll() is not None  # killed, not used


def test_children_never_adopted_are_killed_and_odd_arguments_start_none(tmp_path):
    from tclip.formats.hdf5 import child as children

    path = small_h5(tmp_path / "m.h5", 0.5)
    os.mkfifo(tmp_path / "pipe.h5")
    children.prestart(["--out-dir", str(tmp_path / "none.h5"), str(tmp_path / "pipe.h5"), str(tmp_path)])
    assert children._SPARES == {}  # a missing file, a FIFO, a folder: nothing started
    children.prestart([str(path)])
    (spare, _), = children._SPARES.values()
    children.discard_all()
    assert children._SPARES == {} and spare.poll() is not None


def test_the_command_line_runs_with_a_child_started_early(tmp_path):
    path = small_h5(tmp_path / "m.h5", 0.5)
    result = subprocess.run([sys.executable, "-c", "from tclip.cli.entry import main; main()", "report", "--json",
                             str(path)], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["global_norm"] == pytest.approx(0.5 * math.sqrt(12), rel=1e-15)
    unused = subprocess.run([sys.executable, "-c", "from tclip.cli.entry import main; main()", "report", "--bogus",
                             str(path)], capture_output=True, text=True, timeout=120)
    assert unused.returncode == 2  # a usage error: the child started early is killed on the way out
