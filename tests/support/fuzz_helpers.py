"""Mutation fuzzing of whole commands: valid files of every format, damaged on purpose, run
through ``tclip info``, ``report``, ``norm`` and ``diff`` in child processes.

Each case is fixed by its seed file and its number (``random.Random`` seeded with both), so a
failure is replayed by its id alone. A command may succeed, fail cleanly or find a failed check
(exit 0, 1 or 3); it may not die from a signal, outlive its time, print a traceback or an internal
error, change its input or leave anything beside its output.

Commands run in children forked from one server process that imported tclip once: a child per
command, so a crash of a C library ends that child and is seen as a signal, at a tenth of the cost
of starting an interpreter each time. ``python tests/support/fuzz_helpers.py FIRST COUNT`` runs cases
outside pytest (a long local run) and prints the failures.
"""

from __future__ import annotations

import io
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

import h5py
import numpy as np

# How long one command may take on a file of a few KiB. A hang is what is caught: the
# issue that asked for this test saw `info` still running after 12 s.
COMMAND_SECONDS = 12

# ------------------------------------------------------------------ seed files


def _h5(path: Path, build, **kwargs) -> bytes:
    with h5py.File(path, "w", **kwargs) as f:
        build(f)
    return path.read_bytes()


def _h5_attributes(f: h5py.File) -> None:
    rng = np.random.default_rng(1)
    f.attrs["framework"] = "keras"
    f.attrs["step"] = np.int64(41200)
    f.attrs["lr"] = np.array([1e-3, 5e-4])
    layer = f.create_group("model/layers/17/self_attn")
    layer.attrs["note"] = "attention"
    weight = layer.create_dataset("k_proj.weight", data=(rng.standard_normal((24, 16)) * 3).astype(np.float32))
    weight.attrs["units"] = np.int32(16)
    layer.create_dataset("k_proj.bias", data=rng.standard_normal(16).astype(np.float16))
    f.create_dataset("model/step", data=np.array([3], np.int64))
    f.create_dataset("vocab", data=np.array([b"hello", b"world"]))
    f["model/alias"] = h5py.SoftLink("/model/step")


def _h5_chunked_compressed(f: h5py.File) -> None:
    rng = np.random.default_rng(2)
    f.create_dataset("encoder/layers.0.mlp.up_proj.weight", data=(rng.standard_normal((32, 24)) * 2).astype(np.float32),
                     chunks=(8, 12), compression="gzip", shuffle=True, fletcher32=True)
    f.create_dataset("encoder/layers.0.mlp.down_proj.weight", data=rng.standard_normal((6, 5, 4)),
                     chunks=(2, 5, 4), compression="lzf")
    f.create_dataset("encoder/norm.weight", data=np.ones(24, np.float32), chunks=(24,), compression="gzip",
                     compression_opts=9)
    f["encoder"].attrs["layers"] = np.int64(1)


def _h5_chunked_raw(f: h5py.File) -> None:
    rng = np.random.default_rng(3)
    f.create_dataset("grads/w", data=rng.standard_normal((16, 8)).astype(np.float32), chunks=(4, 8))
    f.create_dataset("grads/v", data=rng.standard_normal((9, 7)).astype(np.float32), chunks=(4, 3))
    sparse = f.create_dataset("grads/sparse", shape=(200,), chunks=(2,), dtype=np.float32, fillvalue=0.25)
    sparse[:4] = np.arange(4)
    f.create_dataset("grads/resizable", data=np.arange(10.0), maxshape=(None,), chunks=(4,))


def _h5_latest(f: h5py.File) -> None:
    rng = np.random.default_rng(4)
    group = f.create_group("layers", track_order=True)
    for i in range(3):
        group.create_dataset(f"dense_{i}/kernel", data=rng.standard_normal((8, 4)).astype(np.float32))
    for i in range(12):  # more than the compact limit: dense attribute storage
        f.attrs[f"attr_{i}"] = f"value {i}"
    space = h5py.h5s.create_simple((4,))
    plist = h5py.h5p.create(h5py.h5p.DATASET_CREATE)
    plist.set_layout(h5py.h5d.COMPACT)
    h5py.h5d.create(f.id, b"compact", h5py.h5t.IEEE_F32LE, space, plist)
    f["compact"][...] = np.arange(4, dtype=np.float32)
    f.create_dataset("scaled", data=rng.standard_normal(64).astype(np.float32), chunks=(16,), scaleoffset=3)
    f.create_dataset("records", data=np.array([(1.0, 2)], dtype=[("x", "<f4"), ("n", "<i4")]))


def _h5_many_chunks(f: h5py.File) -> None:
    # Hundreds of chunks: a B-tree of several levels (version 1 chunk index)
    rng = np.random.default_rng(6)
    f.create_dataset("optimizer/adam/m", data=rng.standard_normal(4096).astype(np.float32), chunks=(8,),
                     compression="gzip", compression_opts=1)
    f.create_dataset("optimizer/adam/v", data=rng.standard_normal((40, 30)).astype(np.float32), chunks=(3, 4))
    group = f.create_group("layers")
    for i in range(40):  # a group of many links: a B-tree and a local heap of names
        group.create_dataset(f"dense_{i}.bias", data=np.full(2, i, np.float32))


def _h5_latest_indexes(f: h5py.File) -> None:
    # The chunk indexes of the newer file format: fixed array, extensible array, version 2 B-tree;
    # a group of many links and a dataset of many attributes (fractal heaps, version 2 B-trees)
    rng = np.random.default_rng(7)
    f.create_dataset("fixed", data=rng.standard_normal((24, 8)).astype(np.float32), chunks=(4, 8),
                     compression="gzip")
    f.create_dataset("extensible", data=rng.standard_normal(300), chunks=(10,), maxshape=(None,))
    f.create_dataset("btree2", data=rng.standard_normal((30, 20)).astype(np.float32), chunks=(5, 5),
                     maxshape=(None, None), shuffle=True, compression="gzip")
    group = f.create_group("blocks", track_order=True)
    for i in range(20):
        group.create_dataset(f"block_{i}.weight", data=np.full((2, 2), i, np.float16))
    for i in range(20):
        f["fixed"].attrs[f"a{i}"] = np.arange(i + 1)


def _npy(array: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    np.save(buffer, array)
    return buffer.getvalue()


def _npz(arrays: dict[str, np.ndarray], compressed: bool) -> bytes:
    """What ``np.savez`` writes, with a fixed member date (NumPy stamps the current time)."""
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as archive:
        for name, array in arrays.items():
            member = zipfile.ZipInfo(f"{name}.npy", date_time=(2024, 1, 1, 0, 0, 0))
            member.compress_type = zipfile.ZIP_DEFLATED if compressed else zipfile.ZIP_STORED
            archive.writestr(member, _npy(array))
    return buffer.getvalue()


def _safetensors(arrays: dict[str, np.ndarray], metadata: dict[str, str]) -> bytes:
    from support.formats_helpers import safetensors_bytes

    return safetensors_bytes(arrays, metadata=metadata)


def _model_tensors() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(5)
    return {"model.layers.17.self_attn.k_proj.weight": (rng.standard_normal((12, 8)) * 3).astype(np.float32),
            "model.layers.17.self_attn.k_proj.bias": rng.standard_normal(8).astype(np.float16),
            "model.norm.weight": rng.standard_normal(8),
            "step": np.array([7], np.int64)}


@dataclass(frozen=True)
class Seed:
    name: str
    suffix: str
    data: bytes
    structure: tuple[tuple[int, int], ...]  # byte ranges that hold no tensor data (headers, indexes)

    @property
    def hot(self) -> np.ndarray:
        """Positions in the structure near a non-zero byte: HDF5 leaves much of its metadata
        blocks empty, and damaging unused space finds nothing."""
        raw = np.frombuffer(self.data, np.uint8)
        inside = np.zeros(raw.size, bool)
        for start, stop in self.structure:
            inside[start:stop] = True
        near = np.convolve(raw != 0, np.ones(17), mode="same") > 0
        return np.flatnonzero(inside & near)


def _h5_data_ranges(path: Path) -> list[tuple[int, int]]:
    ranges: list[tuple[int, int]] = []

    def visit(name: str, obj: object) -> None:
        if not isinstance(obj, h5py.Dataset):
            return
        layout = obj.id.get_create_plist().get_layout()
        if layout == h5py.h5d.CONTIGUOUS and obj.id.get_offset() is not None:
            ranges.append((obj.id.get_offset(), obj.id.get_offset() + obj.id.get_storage_size()))
        elif layout == h5py.h5d.CHUNKED:
            for i in range(obj.id.get_num_chunks()):
                info = obj.id.get_chunk_info(i)
                ranges.append((info.byte_offset, info.byte_offset + info.size))

    with h5py.File(path, "r") as f:
        f.visititems(visit)
    return ranges


def _complement(ranges: list[tuple[int, int]], size: int) -> tuple[tuple[int, int], ...]:
    out, position = [], 0
    for start, stop in sorted(ranges):
        if start > position:
            out.append((position, start))
        position = max(position, stop)
    if position < size:
        out.append((position, size))
    return tuple(out)


def _zip_structure(data: bytes) -> tuple[tuple[int, int], ...]:
    with zipfile.ZipFile(io.BytesIO(data)) as archive:
        ranges = []
        for info in archive.infolist():
            # the local header: 30 bytes, the name and the extra field (read from the header itself)
            local = info.header_offset
            name_length = int.from_bytes(data[local + 26:local + 28], "little")
            extra_length = int.from_bytes(data[local + 28:local + 30], "little")
            start = local + 30 + name_length + extra_length
            ranges.append((start, start + info.compress_size))
    return _complement(ranges, len(data))


def _torch_structure(data: bytes) -> tuple[tuple[int, int], ...]:
    """Everything of a torch.save zip but its storages' bytes: headers, the pickle, the records."""
    with zipfile.ZipFile(io.BytesIO(data)) as archive:
        ranges = []
        for info in archive.infolist():
            if "/data/" in info.filename:
                local = info.header_offset
                start = local + 30 + int.from_bytes(data[local + 26:local + 28], "little") \
                    + int.from_bytes(data[local + 28:local + 30], "little")
                ranges.append((start, start + info.compress_size))
    return _complement(ranges, len(data))


def make_seeds(folder: Path) -> dict[str, Seed]:
    """The valid files every case starts from, by name."""
    seeds: dict[str, Seed] = {}
    for name, build, kwargs in (("h5-attributes", _h5_attributes, {}),
                                ("h5-chunked-compressed", _h5_chunked_compressed, {}),
                                ("h5-chunked-raw", _h5_chunked_raw, {}),
                                ("h5-latest", _h5_latest, {"libver": "latest"}),
                                ("h5-many-chunks", _h5_many_chunks, {}),
                                ("h5-latest-indexes", _h5_latest_indexes, {"libver": "latest"})):
        path = folder / f"{name}.h5"
        data = _h5(path, build, **kwargs)
        seeds[name] = Seed(name, ".h5", data, _complement(_h5_data_ranges(path), len(data)))
    tensors = _model_tensors()
    weight = tensors["model.layers.17.self_attn.k_proj.weight"]
    for name, array in (("npy", weight), ("npy-fortran", np.asfortranarray(weight.astype(">f8")))):
        data = _npy(array)
        seeds[name] = Seed(name, ".npy", data, ((0, len(data) - array.nbytes),))
    for name, compressed in (("npz", False), ("npz-deflated", True)):
        data = _npz(tensors, compressed)
        seeds[name] = Seed(name, ".npz", data, _zip_structure(data))
    data = _safetensors(tensors, {"format": "pt"})
    header = 8 + int.from_bytes(data[:8], "little")
    seeds["safetensors"] = Seed("safetensors", ".safetensors", data, ((0, header),))
    from support import torch_helpers  # (tests/ is on the path under pytest and when run directly)

    # torch's zip layout; with CRC-32s off (all 0, as set_crc32_options(False) writes), damage to the
    # pickle reaches the interpreter instead of failing the pickle's CRC
    for name, crc32 in (("pt", True), ("pt-crc-off", False)):
        path = torch_helpers.save_arrays(folder / f"{name}.pt", tensors, crc32=crc32)
        data = path.read_bytes()
        seeds[name] = Seed(name, ".pt", data, _torch_structure(data))
    return seeds


# ------------------------------------------------------------------ mutations

INTERESTING = (0x00, 0xFF, 0x7F, 0x80, 0x01, 0xFE, 0x10, 0x40)


def mutate(seed: Seed, rng: random.Random) -> tuple[bytes, str]:
    """A damaged copy of the seed and a short account of the damage."""
    data = bytearray(seed.data)
    size = len(data)
    hot = seed.hot

    def position() -> int:
        # Three times in four in the structure: damaged data bytes are mostly just other numbers.
        if hot.size and rng.random() < 0.75:
            return int(hot[rng.randrange(hot.size)])
        return rng.randrange(size)

    kind = rng.choice(("flip", "flip", "edit", "edit", "overwrite", "truncate"))
    if kind == "flip":
        spots = [(position(), rng.randrange(8)) for _ in range(rng.randint(1, 8))]
        for spot, bit in spots:
            data[spot] ^= 1 << bit
        return bytes(data), f"flip {spots}"
    if kind == "edit":
        spots = [(position(), rng.choice(INTERESTING) if rng.random() < 0.5 else rng.randrange(256))
                 for _ in range(rng.randint(1, 6))]
        for spot, value in spots:
            data[spot] = value
        return bytes(data), f"edit {spots}"
    if kind == "overwrite":
        spot, run = position(), bytes(rng.randrange(256) for _ in range(rng.randint(1, 16)))
        data[spot:spot + len(run)] = run
        return bytes(data[:max(size, spot + len(run))]), f"overwrite {spot} {run.hex()}"
    cut = position()
    return bytes(data[:cut]), f"truncate {cut}"


# ------------------------------------------------------------------ running commands

_SERVER = r"""
import json, os, signal, sys, traceback
import numpy
import tclip.cli.commands, tclip.cli.entry
from tclip.formats.hdf5 import import_h5py
import_h5py()
for line in sys.stdin:
    request = json.loads(line)
    pid = os.fork()
    if pid == 0:
        code = 70
        try:
            os.chdir(request["cwd"])
            for fd, name, flags in ((1, request["stdout"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC),
                                    (2, request["stderr"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC),
                                    (0, os.devnull, os.O_RDONLY)):
                opened = os.open(name, flags, 0o600)
                os.dup2(opened, fd)
                os.close(opened)
            signal.alarm(request["seconds"])  # default action: the child ends, seen as SIGALRM
            sys.argv = ["tclip", *request["args"]]
            tclip.cli.entry.main()
        except SystemExit as done:
            code = done.code if isinstance(done.code, int) else 1
        except BaseException:
            traceback.print_exc()
        finally:
            try:
                sys.stdout.flush()
                sys.stderr.flush()
            finally:
                os._exit(code)
    _, status = os.waitpid(pid, 0)
    print(json.dumps({"status": os.waitstatus_to_exitcode(status)}), flush=True)
"""


@dataclass
class Outcome:
    args: list[str]
    status: int  # the exit code, or minus the signal that ended it
    stdout: str
    stderr: str


class CommandServer:
    """A process that forks one child per tclip command (see the module's docstring)."""

    def __init__(self) -> None:
        environment = dict(os.environ, COLUMNS="80", NO_COLOR="1")
        self.process = subprocess.Popen([sys.executable, "-c", _SERVER], stdin=subprocess.PIPE,
                                        stdout=subprocess.PIPE, text=True, env=environment)
        self.scratch = Path(tempfile.mkdtemp(prefix="tclip-fuzz-streams-"))

    def run(self, args: list[str], cwd: Path, seconds: int = COMMAND_SECONDS) -> Outcome:
        assert self.process.stdin is not None and self.process.stdout is not None
        out, err = self.scratch / "stdout", self.scratch / "stderr"
        request = {"args": args, "cwd": str(cwd), "stdout": str(out), "stderr": str(err), "seconds": seconds}
        self.process.stdin.write(json.dumps(request) + "\n")
        self.process.stdin.flush()
        reply = json.loads(self.process.stdout.readline())
        return Outcome(args, reply["status"], out.read_text(errors="replace"), err.read_text(errors="replace"))

    def close(self) -> None:
        if self.process.stdin is not None:
            self.process.stdin.close()
        self.process.wait(timeout=60)
        if self.process.stdout is not None:
            self.process.stdout.close()
        shutil.rmtree(self.scratch, ignore_errors=True)


def commands(name: str, reference: Path) -> list[list[str]]:
    """Every command a user runs on such a file: they read it, check it, clip it and compare it."""
    suffix = Path(name).suffix
    return [["info", name],
            ["report", "--stats", "--axes", "1", name],
            ["norm", "--clip", "1", "--nonfinite", "propagate", "-o", f"out{suffix}", name],
            ["diff", name, str(reference)]]


def problems(outcome: Outcome) -> list[str]:
    """What is wrong with how one command ended (nothing when it ended well)."""
    found = []
    if outcome.status == -14:
        found.append(f"still running after {COMMAND_SECONDS} s")
    elif outcome.status < 0:
        found.append(f"killed by signal {-outcome.status}")
    elif outcome.status not in (0, 1, 3):
        found.append(f"exit status {outcome.status}")
    for word in ("Traceback", "internal error"):
        if word in outcome.stderr:
            found.append(f"{word!r} on stderr")
    if outcome.status == 1 and not outcome.stderr.lstrip().startswith("Error: ") \
            and "Error: " not in outcome.stderr:
        found.append("exit 1 without an Error: line")
    return [f"{' '.join(outcome.args[:-1] if outcome.args[0] == 'diff' else outcome.args)}: {p}" for p in found] \
        + ([f"    stderr: {outcome.stderr.strip()[-600:]}"] if found else [])


def run_case(seed: Seed, number: int, server: CommandServer, folder: Path, reference: Path) -> list[str]:
    """Damage ``seed`` as case ``number`` says, run every command on it, return what went wrong."""
    payload, account = mutate(seed, random.Random(f"{seed.name}/{number}"))
    return run_payload(seed, payload, f"case {number} ({account})", server, folder, reference)


def flipped(seed: Seed, bits: list[tuple[int, int]]) -> bytes:
    """The seed with these (byte, bit) flipped: a case found once, kept as a regression."""
    data = bytearray(seed.data)
    for position, bit in bits:
        data[position] ^= 1 << bit
    return bytes(data)


def run_payload(seed: Seed, payload: bytes, account: str, server: CommandServer, folder: Path,
                reference: Path) -> list[str]:
    """Run every command on a damaged copy of ``seed``; what went wrong."""
    work = Path(tempfile.mkdtemp(prefix=f"{seed.name}-", dir=folder))
    name = f"model.layers{seed.suffix}"
    (work / name).write_bytes(payload)
    found: list[str] = []
    for args in commands(name, reference):
        outcome = server.run(args, work)
        found += problems(outcome)
        if (work / name).read_bytes() != payload:
            found.append(f"{' '.join(args)}: the input was changed")
        left = sorted(p.name for p in work.iterdir())
        extra = [p for p in left if p not in (name, f"out{seed.suffix}")]
        if extra:
            found.append(f"{' '.join(args)}: left {extra}")
        if args[0] == "norm" and outcome.status == 0 and not (work / f"out{seed.suffix}").exists():
            found.append(f"{' '.join(args)}: exit 0 without its output")
    shutil.rmtree(work, ignore_errors=True)
    return [f"{seed.name} {account}:"] + found if found else []


def write_references(seeds: dict[str, Seed], folder: Path) -> dict[str, Path]:
    """The undamaged seeds, which ``diff`` compares each damaged file with."""
    folder.mkdir(parents=True, exist_ok=True)
    paths = {}
    for seed in seeds.values():
        paths[seed.name] = folder / f"{seed.name}{seed.suffix}"
        paths[seed.name].write_bytes(seed.data)
        paths[seed.name].chmod(0o444)
    return paths


def main(argv: list[str]) -> int:
    """``python tests/support/fuzz_helpers.py FIRST COUNT [SEED...]``: cases FIRST..FIRST+COUNT-1 of each seed."""
    first, count = int(argv[0]), int(argv[1])
    folder = Path(tempfile.mkdtemp(prefix="tclip-fuzz-"))
    seeds = make_seeds(folder)
    wanted = argv[2:] or list(seeds)
    references = write_references(seeds, folder / "references")
    server = CommandServer()
    failures = cases = 0
    try:
        for number in range(first, first + count):
            for name in wanted:
                cases += 1
                found = run_case(seeds[name], number, server, folder, references[name])
                if found:
                    failures += 1
                    print("\n".join(found), flush=True)
    finally:
        server.close()
        shutil.rmtree(folder, ignore_errors=True)
    print(f"{cases} cases, {failures} with problems", flush=True)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    sys.exit(main(sys.argv[1:]))
