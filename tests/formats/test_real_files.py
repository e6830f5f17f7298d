"""Files real libraries write, and every signal (issue 12)."""

from __future__ import annotations

import json
import os
import signal
import stat
import subprocess
import sys
import time
import warnings
from pathlib import Path

import h5py
import numpy as np
import pytest

from support import torch_helpers
from support.cli import run
from support.formats_helpers import read_all, safetensors_bytes
from tclip.formats import open_reader
from tclip.formats.atomic import AtomicOutput

RNG = np.random.default_rng(55)
NUMPY_DATA = Path(np.__file__).parent / "lib" / "tests" / "data"


def tclip_process(*args, **kwargs):
    return subprocess.run([sys.executable, "-m", "tclip", *map(str, args)], capture_output=True, text=True, **kwargs)


# ------------------------------------------------------------------ 1. attributes have a JSON and a text form


@pytest.fixture
def keras_h5(tmp_path) -> Path:
    """The layout Keras 2 writes (model.save_weights(...h5)): byte-string name arrays, nested groups."""
    path = tmp_path / "keras.h5"
    with h5py.File(path, "w") as f:
        f.attrs["layer_names"] = np.array([b"dense", b"dense_1"], dtype="S7")
        f.attrs["backend"] = b"tensorflow"
        f.attrs["keras_version"] = b"2.15.0"
        f.attrs["model_config"] = json.dumps({"config": {"batch_shape": [None, 8, 8, 3]}}).encode()
        for layer in ("dense", "dense_1"):
            group = f.create_group(layer)
            group.attrs["weight_names"] = np.array([f"{layer}/kernel:0".encode(), f"{layer}/bias:0".encode()])
            group.create_dataset(f"{layer}/kernel:0", data=RNG.standard_normal((8, 4)).astype(np.float32))
            group.create_dataset(f"{layer}/bias:0", data=np.zeros(4, np.float32))
    return path


@pytest.fixture
def netcdf_like(tmp_path) -> Path:
    """The layout netCDF-C writes: dimension scales attached to variables, references, empty attributes."""
    path = tmp_path / "nc.h5"
    with h5py.File(path, "w") as f:
        time_ = f.create_dataset("time", data=np.arange(5.0))
        time_.make_scale("time")
        var = f.create_dataset("grad", data=RNG.standard_normal((5, 3)).astype(np.float32))
        var.dims[0].attach_scale(time_)
        var.attrs["units"] = "1"
        var.attrs["_FillValue"] = np.float32(-999)
        var.attrs["empty"] = h5py.Empty("f4")
        var.attrs["points_to"] = time_.ref
        var.attrs["region"] = var.regionref[0:2, :]
    return path


@pytest.mark.parametrize("command", ["info", "report"])
def test_json_of_every_attribute_kind(keras_h5, netcdf_like, command):
    result = run(command, "--json", keras_h5, netcdf_like)
    assert result.exit_code == 0, result.stderr
    keras, nc = (json.loads(line) for line in result.stdout.splitlines())
    metadata = keras["metadata"]
    assert metadata["layer_names"] == ["dense", "dense_1"] and metadata["backend"] == "tensorflow"
    if command == "info":
        attrs = {t["name"]: t["attrs"] for t in nc["tensors"]}["grad"]
        assert attrs["empty"] is None and attrs["points_to"] == "<reference to /time>"
        assert attrs["region"] == "<region reference to /grad>" and attrs["units"] == "1"
        assert isinstance(attrs["DIMENSION_LIST"], list)
    assert [o["name"] for o in nc["not_tensors"]] == ["time"]


def test_text_form_shows_values_literally(keras_h5):
    result = run("info", keras_h5)
    assert result.exit_code == 0
    assert '"batch_shape": [null, 8, 8, 3]' in result.stdout and "['dense', 'dense_1']" not in result.stdout
    assert '["dense", "dense_1"]' in result.stdout


# ------------------------------------------------------------------ 2. text from files is data


def test_markup_and_escapes_in_names_and_metadata_are_printed_literally(tmp_path):
    path = tmp_path / "g.safetensors"
    path.write_bytes(safetensors_bytes({"evil\x1b[2Jname": np.ones(2, np.float32), "w[/x]": np.ones(2, np.float32)},
                                       metadata={"note": "grads of LM; [tied] emb/head", "bad": "[/x] [bold]x"}))
    for command in ("info", "report"):
        result = run(command, path)
        assert result.exit_code == 0, result.output
        assert "\x1b" not in result.stdout
        assert "evil\\x1b[2Jname" in result.stdout and "w[/x]" in result.stdout
        if command == "info":
            assert "grads of LM; [tied] emb/head" in result.stdout and "[/x] [bold]x" in result.stdout
    error = run("norm", "--clip", "1", "--include", "evil*", "--nonfinite", "error", path)
    assert error.exit_code == 0 and "\x1b" not in error.stdout + error.stderr


# ------------------------------------------------------------------ 3-4. .npy versions and numpy's own files


def test_npy_version_3_and_2(tmp_path):
    for version in ((2, 0), (3, 0)):
        path = tmp_path / f"v{version[0]}.npy"
        with open(path, "wb") as handle:
            np.lib.format.write_array(handle, np.arange(6, dtype=np.float32).reshape(2, 3), version=version)
        result = run("norm", "--clip", "1", path)
        assert result.exit_code == 0, result.stderr
        np.testing.assert_allclose(np.linalg.norm(np.load(tmp_path / f"v{version[0]}.clipped.npy")), 1, rtol=1e-6)


@pytest.mark.skipif(not NUMPY_DATA.exists(), reason="this NumPy ships no test data")
def test_numpys_own_test_files_give_no_raw_warning():
    result = tclip_process("report", NUMPY_DATA / "win64python2.npy")
    assert result.returncode == 0 and "UserWarning" not in result.stderr and result.stderr == ""
    objects = tclip_process("report", NUMPY_DATA / "py3-objarr.npy")
    assert objects.returncode == 1 and objects.stderr.count("\n") == 1 and "pickle" in objects.stderr


# ------------------------------------------------------------------ 5. HDF5 filters h5py lacks


def test_blosc_compressed_file_with_hdf5plugin(tmp_path):
    hdf5plugin = pytest.importorskip("hdf5plugin")
    path = tmp_path / "blosc.h5"
    with h5py.File(path, "w") as f:
        f.create_dataset("w", data=RNG.standard_normal((64, 64)).astype(np.float32) * 10,
                         chunks=(16, 64), **hdf5plugin.Blosc())
    assert run("norm", "--clip", "1", path).exit_code == 0
    with h5py.File(tmp_path / "blosc.clipped.h5", "r") as f:
        assert np.linalg.norm(f["w"][()]) == pytest.approx(1.0, rel=1e-6)
        assert 32001 in [f["w"].id.get_create_plist().get_filter(i)[0]
                         for i in range(f["w"].id.get_create_plist().get_nfilters())]
    code = ("import sys; sys.modules['hdf5plugin'] = None\n"
            f"sys.argv = ['tclip', 'norm', '--clip', '1', '--dry-run', {str(path)!r}]\n"
            "from tclip.cli.entry import main\nmain()")
    env = {k: v for k, v in os.environ.items() if k != "HDF5_PLUGIN_PATH"}
    env["TCLIP_HDF5_PROBE"] = "0"
    missing = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert missing.returncode == 1
    assert "compressed with blosc" in missing.stderr and "pip install 'tclip[hdf5-filters]'" in missing.stderr


# ------------------------------------------------------------------ 6-7. what a tool cannot read, and conversions


def test_one_unreadable_dataset_does_not_refuse_the_file(tmp_path):
    # Selected, it may hold floats: the clip says so (tests/hostile/test_unmeasured_exit.py);
    # left out by name, it is carried byte for byte and the rest is clipped.
    path = tmp_path / "quad.h5"
    with h5py.File(path, "w") as f:
        f.create_dataset("extended", data=np.arange(3, dtype=np.longdouble))
        f.create_dataset("w", data=np.full(4, 3.0, np.float32))
    assert run("norm", "--clip", "1", path).exit_code == 1
    result = run("norm", "--clip", "1", "--exclude", "extended", path)
    assert result.exit_code == 0, result.stderr
    with h5py.File(path, "r") as a, h5py.File(tmp_path / "quad.clipped.h5", "r") as b:
        assert a["extended"][()].tobytes() == b["extended"][()].tobytes()
        assert np.linalg.norm(b["w"][()]) == pytest.approx(1.0, rel=1e-6)
    st = tmp_path / "f4.safetensors"
    header = json.dumps({"a": {"dtype": "F4", "shape": [4], "data_offsets": [0, 2]},
                         "w": {"dtype": "F32", "shape": [2], "data_offsets": [2, 10]}}).encode()
    header += b" " * (-len(header) % 8)
    st.write_bytes(len(header).to_bytes(8, "little") + header + b"\x12\x34" + np.array([3, 4], np.float32).tobytes())
    assert run("norm", "--clip", "1", st).exit_code == 1
    result = run("norm", "--clip", "1", "--exclude", "a", st)
    assert result.exit_code == 0 and "1 not selected" in result.stdout
    out = (tmp_path / "f4.clipped.safetensors").read_bytes()
    assert out[8 + len(header):10 + len(header)] == b"\x12\x34"


def test_conversions_carry_faithfully_or_refuse(keras_h5, tmp_path):
    result = run("norm", "--clip", "100", "-o", tmp_path / "k.safetensors", keras_h5)
    assert result.exit_code == 1 and "the attributes of" in result.stderr  # Keras keeps names in attributes
    dropped = run("norm", "--clip", "100", "--drop-nonnumeric", "-o", tmp_path / "k.safetensors", keras_h5)
    assert dropped.exit_code == 0 and "Warning: " in dropped.stderr
    with open_reader(tmp_path / "k.safetensors") as reader:
        assert reader.metadata["backend"] == "tensorflow"  # not "b'tensorflow'"
        assert json.loads(reader.metadata["layer_names"]) == ["dense", "dense_1"]


# ------------------------------------------------------------------ 8-9, 12. signals and temporary files


def big_file(folder: Path, suffix: str, mib: int = 48) -> Path:
    rows = mib * (1 << 20) // 4 // 1024
    data = RNG.standard_normal((rows, 1024)).astype(np.float32)
    path = folder / f"big{suffix}"
    if suffix == ".npy":
        np.save(path, data)
    elif suffix == ".npz":
        np.savez(path, a=data[: rows // 2], b=data[rows // 2:])
    elif suffix == ".safetensors":
        path.write_bytes(safetensors_bytes({"a": data[: rows // 2], "b": data[rows // 2:]}))
    elif suffix == ".pt":
        torch_helpers.save_arrays(path, {"a": data[: rows // 2], "b": data[rows // 2:]})
    else:
        with h5py.File(path, "w") as f:
            f.create_dataset("a", data=data[: rows // 2])
            f.create_dataset("b", data=data[rows // 2:], chunks=(256, 1024))
    return path


def interrupted(args: list[str], folder: Path, signum: int, delay: float) -> subprocess.CompletedProcess:
    process = subprocess.Popen([sys.executable, "-m", "tclip", *args], stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and not list(folder.glob("*.tclip-tmp")) and process.poll() is None:
        time.sleep(0.002)
    time.sleep(delay)
    if process.poll() is None:
        process.send_signal(signum)
    out, err = process.communicate(timeout=120)
    return subprocess.CompletedProcess(args, process.returncode, out, err)


@pytest.mark.parametrize("suffix", [".npy", ".npz", ".safetensors", ".h5", ".pt"])
@pytest.mark.parametrize("signum,delay", [(signal.SIGTERM, 0.0), (signal.SIGHUP, 0.05), (signal.SIGINT, 0.0),
                                          (signal.SIGKILL, 0.02)],
                         ids=["TERM", "HUP", "INT", "KILL"])
@pytest.mark.parametrize("in_place", [False, True], ids=["new", "in-place"])
def test_a_signal_leaves_the_old_or_the_new_file(tmp_path, suffix, signum, delay, in_place):
    source = big_file(tmp_path, suffix)
    before = source.read_bytes()
    target = source if in_place else tmp_path / f"big.clipped{suffix}"
    args = ["global", "--clip", "1", "--threads", "1", str(source)] + (["--in-place"] if in_place else [])
    result = interrupted(args, tmp_path, signum, delay)
    expected = {signal.SIGTERM: 143, signal.SIGHUP: 129, signal.SIGINT: 130, signal.SIGKILL: -9}[signum]
    assert result.returncode in (0, expected), result.stderr
    assert "Traceback" not in result.stderr
    if result.returncode not in (0, -9):
        assert len(result.stderr.strip().splitlines()) == 1 and result.stderr.startswith("Error: ")
    temps = list(tmp_path.glob("*.tclip-tmp"))
    if signum != signal.SIGKILL:
        assert temps == []
    if target.exists() and (result.returncode != 0 or not in_place):
        data = target.read_bytes()
        if data != before:  # the complete new file
            got = read_all(target)
            assert np.sqrt(sum(np.sum(v.astype(np.float64) ** 2) for v in got.values())) == pytest.approx(1, 1e-5)
    if temps:  # only SIGKILL: the next run in this folder removes it
        run("report", source)
        assert run("global", "--clip", "1", "--dry-run", "-o", tmp_path / "x.npz", source).exit_code in (0, 1)
        other = run("norm", "--clip", "1", "--force", "-o", tmp_path / f"again{suffix}", source)
        assert other.exit_code == 0, other.stderr
        assert not list(tmp_path.glob("*.tclip-tmp"))


def test_a_signal_right_after_the_temporary_file_is_created_still_removes_it(tmp_path, monkeypatch):
    """The window the signal test above hit under load (a TERM as soon as the temporary
    file appeared left it behind): the handler removes every temporary file that exists."""
    from tclip import interrupt
    from tclip.cli import entry
    from tclip.formats import atomic

    real_open = os.open

    def open_then_signal(path, flags, *args):
        fd = real_open(path, flags, *args)
        if str(path).endswith(atomic.TEMP_SUFFIX):
            os.close(fd)
            raise interrupt.Terminated(signal.SIGTERM)  # the handler runs at the next bytecode
        return fd

    monkeypatch.setattr(atomic.os, "open", open_then_signal)
    with pytest.raises(interrupt.Terminated):
        AtomicOutput(tmp_path / "out.h5")
    monkeypatch.undo()
    assert len(list(tmp_path.glob("*.tclip-tmp"))) == 1
    assert entry._remove_live_temps() == 1  # what the command line does on a signal
    assert list(tmp_path.iterdir()) == []


def test_keras3_weights_file_keeps_the_suffix_keras_loads_by(tmp_path):
    source = tmp_path / "model.weights.h5"  # Keras 3's save_weights layout
    with h5py.File(source, "w") as f:
        f.create_dataset("layers/dense/vars/0", data=np.full((4, 3), 2.0, np.float32))
        f.create_dataset("layers/dense/vars/1", data=np.ones(3, np.float32))
    result = run("global", "--clip", "1", tmp_path)
    assert result.exit_code == 0, result.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.clipped.weights.h5", "model.weights.h5"]
    again = run("report", "--json", tmp_path)  # tclip's own output is not picked up by a directory
    assert [json.loads(line)["file"] for line in again.stdout.splitlines()] == [str(source)]


def test_a_keras_archive_is_named_with_where_its_weights_are(tmp_path):
    import zipfile

    source = tmp_path / "model.keras"  # the layout Keras 3's model.save writes
    with zipfile.ZipFile(source, "w") as archive:
        archive.writestr("metadata.json", "{}")
        archive.writestr("config.json", "{}")
        archive.writestr("model.weights.h5", b"")
    result = run("info", source)
    assert result.exit_code == 1
    assert result.stderr.startswith("Error: ") and "model.weights.h5" in result.stderr
    assert len(result.stderr.splitlines()) == 1


def test_temps_of_dead_runs_on_this_host_are_removed_once_and_nothing_else(tmp_path):
    from tclip.formats import atomic as base
    finished = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                              text=True, check=True)
    dead = int(finished.stdout)
    stale = tmp_path / f".g.npy.{base._HOST}.{dead}.0123abcd.tclip-tmp"
    alive = tmp_path / f".g.npy.{base._HOST}.{os.getppid()}.0123abcd.tclip-tmp"
    other_host = tmp_path / f".g.npy.otherhost.{dead}.0123abcd.tclip-tmp"
    lookalike = tmp_path / f".g.npy.{base._HOST}.{dead}.tclip-tmp"
    for path in (stale, alive, other_host, lookalike):
        path.write_bytes(b"x")
    np.save(tmp_path / "g.npy", np.ones(4))
    assert run("norm", "--clip", "1", tmp_path / "g.npy").exit_code == 0
    assert not stale.exists()
    assert alive.exists() and other_host.exists() and lookalike.exists()
    stale.write_bytes(b"x")  # the folder is looked at once per process
    assert run("norm", "--clip", "1", "--force", tmp_path / "g.npy").exit_code == 0
    assert stale.exists()


@pytest.mark.parametrize("writes", [False, True], ids=["report", "clip"])
def test_the_last_words_on_a_signal_mention_outputs_only_when_there_were_some(tmp_path, writes):
    code = (
        "import signal, sys\n"
        "from pathlib import Path\n"
        "from tclip.cli import runner\n"
        "from tclip.interrupt import Terminated\n"
        "from tclip.formats.atomic import AtomicOutput\n"
        "def stopped(**kwargs):\n"
        f"    if {writes}:\n"
        f"        AtomicOutput(Path({str(tmp_path / 'out.npy')!r}))  # an output in the making\n"
        "    raise Terminated(signal.SIGTERM)\n"
        "runner.run_report = stopped\n"
        "sys.argv = ['tclip', 'report', 'x.npy']\n"
        "from tclip.cli.entry import main\n"
        "main()\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.returncode == 143
    expected = "Error: terminated by SIGTERM" + ("; unfinished outputs were removed" if writes else "")
    assert result.stderr == expected + "\n"
    assert list(tmp_path.iterdir()) == []


def test_temporary_file_has_the_final_mode_from_the_start(tmp_path):
    source = tmp_path / "private.npy"
    np.save(source, np.ones(3))
    os.chmod(source, 0o600)
    output = AtomicOutput(tmp_path / "out.npy", mode_from=source)
    assert stat.S_IMODE(os.stat(output.temp).st_mode) == 0o600
    output.abort()
    os.chmod(source, 0o4755)
    assert run("norm", "--clip", "1", source).exit_code == 0
    assert stat.S_IMODE(os.stat(tmp_path / "private.clipped.npy").st_mode) == 0o755  # setuid dropped


# ------------------------------------------------------------------ 13. links, special files, names


def test_in_place_on_a_symlink_replaces_the_target_and_keeps_the_link(tmp_path):
    real = tmp_path / "real.npy"
    np.save(real, np.full(4, 10.0, np.float32))
    link = tmp_path / "link.npy"
    link.symlink_to(real)
    assert run("norm", "--clip", "1", "--in-place", link).exit_code == 0
    assert link.is_symlink() and np.linalg.norm(np.load(real)) == pytest.approx(1.0, rel=1e-6)


def test_in_place_on_a_hard_link_warns(tmp_path):
    a = tmp_path / "a.npy"
    np.save(a, np.full(4, 10.0, np.float32))
    os.link(a, tmp_path / "b.npy")
    result = run("norm", "--clip", "1", "--in-place", a)
    assert result.exit_code == 0 and "other hard link" in result.stderr
    assert np.linalg.norm(np.load(tmp_path / "b.npy")) == pytest.approx(20.0)  # the other name keeps the old data


def test_fifo_is_refused_without_blocking(tmp_path):
    fifo = tmp_path / "pipe.npy"
    os.mkfifo(fifo)
    result = tclip_process("report", fifo, timeout=30)
    assert result.returncode == 1 and "not a regular file" in result.stderr


def test_unsafe_member_names_are_refused_in_npz(tmp_path):
    source = tmp_path / "g.safetensors"
    source.write_bytes(safetensors_bytes({"../../x": np.ones(2, np.float32), "/abs": np.ones(2, np.float32)}))
    result = run("norm", "--clip", "1", "-o", tmp_path / "g.npz", source)
    assert result.exit_code == 1 and "unsafe .npz member path" in result.stderr
    assert not (tmp_path / "g.npz").exists()


def test_every_file_pytables_ships_works_or_is_refused_in_one_line(tmp_path):
    """PyTables' own test files (tables, compound and enum datasets, links, filters, old
    formats): never a traceback, the inputs untouched, and PyTables reads back what tclip wrote."""
    tables = pytest.importorskip("tables")
    import shutil

    files = sorted((Path(tables.__file__).parent / "tests").glob("*.h5"))
    assert len(files) >= 40
    work = tmp_path / "in"
    work.mkdir()
    for f in files:
        shutil.copy(f, work / f.name)
    before = {p.name: p.read_bytes() for p in work.iterdir()}
    inputs = sorted(work.iterdir())
    commands = (["info", "--json"], ["report", "--json"], ["norm", "--clip", "0.5", "--out-dir", tmp_path / "out"])
    running = [subprocess.Popen([sys.executable, "-m", "tclip", *map(str, args), *map(str, inputs)],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for args in commands]
    for args, process in zip(commands, running):
        out, err = process.communicate(timeout=600)
        result = subprocess.CompletedProcess(args, process.returncode, out, err)
        assert result.returncode in (0, 1), result.stderr
        lines = result.stderr.splitlines()
        assert [line for line in lines if not line.startswith(("Error: ", "Warning: "))] == [], result.stderr
        errors = [line for line in lines if line.startswith("Error: ")]
        if args[1] == "--json":
            assert len([json.loads(line) for line in result.stdout.splitlines()]) == len(files) - len(errors)
    assert {p.name: p.read_bytes() for p in work.iterdir()} == before
    written = sorted((tmp_path / "out").iterdir())
    assert len(written) >= 30

    def nodes(path: Path) -> list[str]:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # PyTables' own warnings about what these files hold
            with tables.open_file(str(path)) as handle:
                return [node._v_pathname for node in handle.walk_nodes()]

    for out in written:
        assert nodes(out) == nodes(work / out.name)


def test_a_compressed_npz_with_strings_and_dates_is_clipped_and_carries_them(tmp_path):
    source = tmp_path / "g.npz"
    np.savez_compressed(source, w=np.full((3, 3), 5.0, np.float32), names=np.array(["fc1", "fc2"]),
                        when=np.array(["2026-11-22"], dtype="datetime64[D]"))
    result = run("norm", "--clip", "1", source)
    assert result.exit_code == 0, result.stderr
    with np.load(tmp_path / "g.clipped.npz") as out:
        assert list(out) == ["w", "names", "when"]
        assert out["names"].tolist() == ["fc1", "fc2"] and str(out["when"][0]) == "2026-11-22"
        np.testing.assert_allclose(np.linalg.norm(out["w"]), 1.0, rtol=1e-6)
