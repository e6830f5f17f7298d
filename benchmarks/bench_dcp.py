"""The DCP targets in one run: ``report`` on a DCP folder against the same tensors in one safetensors
file, ``tclip convert`` DCP -> safetensors against ``dd conv=fsync`` and against torch's own route,
and the peak memory of every command on a checkpoint larger than the default ``--memory``.

    python benchmarks/bench_dcp.py [--quick] [--mib 512] [--repeat 5] [--torch-repeat 2]
                                   [--stage-repeat 3] [--dir /tmp] [--no-prime] [--no-stages] [--keep]

Writes --mib MiB of float32 tensors (16 tensors, rows of 2048) as one safetensors file and, with the
real ``torch.distributed.checkpoint`` in a child process (torch is needed here, never by tclip), as a
DCP folder from one process (every tensor one chunk) and from two gloo ranks (even tensors
``Shard(0)``, odd ones ``Shard(1)``: every tensor two chunks, in two files). Then, each command a
fresh process, in alternating order with a warm page cache and an untimed ``sync`` before each:

- ``tclip report -q`` of the three (medians of --repeat, after an untimed round);
- ``tclip convert -q FOLDER OUT/`` of both folders, ``dd bs=8M conv=fsync`` of the safetensors file
  (the same bytes made durable: the floor) and, in the first --torch-repeat rounds, torch's route
  (``dcp_to_torch_save`` + ``torch.load`` + ``safetensors.torch.save_file``, as users convert today);
  peak RSS read by GNU time. Before each command that writes (dd included) an untimed durable copy
  of the safetensors file is written beside the output and deleted, so that each writes into blocks
  a file has just freed (--no-prime: not; see bench_speed.py and RESULTS.md on why);
- ``info``, ``report``, ``report --summary``, ``diff`` (against the safetensors file and DCP against
  DCP), ``convert`` and the clipping commands (``global``, ``norm`` with ``--out-dir``) once each on
  both folders, for their peak RSS (a clip that this build refuses to write as DCP is listed as
  not measured).

The conversions are checked (``tclip diff`` of each output against the safetensors file says
``same``). Then the same work inside one process, medians of --stage-repeat runs, each stage timed
with ``time.perf_counter`` around the functions that do it: for ``report`` the imports, opening the
folder, reading each chunk's zip (``.pt`` reader) and pass 1; for ``convert`` opening, the chunk
zips, reading (``preadv``), the kernel copy (``copy_file_range``), the writes (``pwrite`` and the
write-back it starts), ``fsync`` and the Python between them; the command's wall time minus these
is "start-up and the rest" (the interpreter, imports, the CLI). Last, one line per target: the ratio
in this run, the limit, met or MISSED, and for a missed one the stage that holds it back; under each
conversion's line, shown but not judged, the same conversion inside one process against dd (where
the ratio goes on a checkpoint large enough for the start-up to fade).

--quick: 96 MiB, 2 rounds, torch's route once, 1 stage run (a smoke run: its figures mean little,
and the memory targets are not judged below the 256 MiB of the default --memory).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from bench_speed import Target, compile_tclip, largest, parts_text  # noqa: E402

TCLIP = [sys.executable, "-m", "tclip"]
MEMORY_MIB = 256  # tclip's default --memory: the peak RSS limit of every command
GNU_TIME = "/usr/bin/time"
INPUTS = ("safetensors", "DCP, 1 process", "DCP, 2 ranks")
TORCH_ROUTE = """
import sys, torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
from safetensors.torch import save_file
dcp_to_torch_save(sys.argv[1], sys.argv[2] + ".pt")
state = torch.load(sys.argv[2] + ".pt", weights_only=True)
save_file({k: v.contiguous() for k, v in state.items()}, sys.argv[2])
"""


# --------------------------------------------------------------------------- the checkpoints


def tensors(mib: int, count: int = 16) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    rows = max(2, (mib << 20) // (count * 2048 * 4))
    return {f"layers.{i}.mlp.weight": rng.standard_normal((rows, 2048), dtype=np.float32) for i in range(count)}


def _rank(rank: int, port: int, source: str, folder: str) -> None:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from safetensors.torch import load_file
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    mesh = init_device_mesh("cpu", (2,))
    state = {name: distribute_tensor(t, mesh, [Shard(i % 2)]) for i, (name, t) in enumerate(load_file(source).items())}
    dcp.save(state, checkpoint_id=folder)
    dist.barrier()
    dist.destroy_process_group()


def write_dcp(source: Path, single: Path, ranks: Path) -> str:
    import torch
    import torch.distributed.checkpoint as dcp
    import torch.multiprocessing as mp
    from safetensors.torch import load_file

    dcp.save(load_file(str(source)), checkpoint_id=str(single), no_dist=True)
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    mp.spawn(_rank, args=(port, str(source), str(ranks)), nprocs=2, join=True)
    return f"torch {torch.__version__}"


def make_inputs(root: Path, mib: int) -> tuple[dict[str, Path], str]:
    """The three inputs, written by a child process (torch stays out of this one)."""
    files = {"safetensors": root / "same.safetensors", "DCP, 1 process": root / "step-1",
             "DCP, 2 ranks": root / "step-2"}
    stamp = root / f"written-{mib}.txt"
    if not stamp.exists():
        for path in files.values():
            shutil.rmtree(path, ignore_errors=True) if path.is_dir() else path.unlink(missing_ok=True)
        subprocess.run([sys.executable, __file__, "--make", str(root), str(mib)], check=True,
                       stderr=subprocess.DEVNULL)
    return files, stamp.read_text().strip()


def make_main(root: Path, mib: int) -> None:
    from safetensors.numpy import save_file

    save_file(tensors(mib), str(root / "same.safetensors"))
    writer = write_dcp(root / "same.safetensors", root / "step-1", root / "step-2")
    (root / f"written-{mib}.txt").write_text(writer)


# --------------------------------------------------------------------------- running


class Runner:
    """Runs commands as fresh processes: wall time, peak RSS (GNU time reads it: a child forked
    from this process would count this one's pages as its own), with the disk primed first."""

    def __init__(self, prime_source: Path | None, scratch: Path) -> None:
        self.prime_source = prime_source
        self.scratch = scratch

    def prime(self, beside: Path) -> None:
        """Untimed: a durable copy of the input beside the output, deleted at once, so that the
        command writes into blocks a file has just freed (see bench_speed.prime_disk)."""
        if self.prime_source is None:
            return
        copy = beside / "prime.scratch"
        subprocess.run(["dd", f"if={self.prime_source}", f"of={copy}", "bs=8M", "conv=fsync", "status=none"],
                       check=True)
        copy.unlink()

    def run(self, command: list[str], writes: Path | None = None,
            ok: tuple[int, ...] = (0,)) -> tuple[float, float, float, str]:
        """(wall seconds, peak RSS MiB, CPU seconds, stderr) of one run; ``writes``: the output
        folder, emptied and primed first. Raises SystemExit on an exit status not in ``ok``."""
        if writes is not None:
            shutil.rmtree(writes, ignore_errors=True)
            writes.mkdir(parents=True)
            self.prime(writes)
        os.sync()
        report = self.scratch / "time.txt"
        wrapped = [GNU_TIME, "-f", "%M %U %S", "-o", str(report), *command] if os.path.exists(GNU_TIME) else command
        started = time.perf_counter()
        done = subprocess.run(wrapped, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        wall = time.perf_counter() - started
        error = done.stderr.decode(errors="replace")
        if done.returncode not in ok:
            raise SystemExit(f"{' '.join(command)} failed ({done.returncode}):\n{error}")
        rss = cpu = float("nan")
        if wrapped is not command:
            fields = report.read_text().split()[-3:]
            rss, cpu = int(fields[0]) / 1024, float(fields[1]) + float(fields[2])
        return wall, rss, cpu, error


def rounds(runner: Runner, suite: dict[str, tuple[list[str], Path | None]], repeat: int,
           only_first: dict[str, int] | None = None) -> dict[str, list[tuple[float, float, float]]]:
    """Alternating rounds after an untimed one (the page cache, the interpreters); a command in
    ``only_first`` runs in that many timed rounds only."""
    only_first = only_first or {}
    results: dict[str, list[tuple[float, float, float]]] = {name: [] for name in suite}
    for round_ in range(repeat + 1):
        order = list(suite.items())
        if round_ % 2:
            order.reverse()
        for name, (command, writes) in order:
            if name in only_first and (round_ == 0 or round_ > only_first[name]):
                continue
            wall, rss, cpu, _ = runner.run(command, writes)
            if round_:
                results[name].append((wall, rss, cpu))
    return results


def table(title: str, results: dict[str, list[tuple[float, float, float]]], base: str, size: int) -> dict[str, float]:
    """Print medians, min-max, the ratio to ``base``, CPU time (user + system, less swayed by
    other jobs than wall time) and peak RSS; returns the medians of the wall times."""
    medians = {name: statistics.median(w for w, _, _ in runs) for name, runs in results.items()}
    print(f"\n{title}")
    print(f"{'':28} {'median s':>9} {'min-max s':>13} {'x ' + base:>20} {'MB/s':>6} {'cpu s':>6} {'peak MiB':>9}")
    for name, runs in results.items():
        walls = [w for w, _, _ in runs]
        print(f"{name:28} {medians[name]:9.3f} {min(walls):6.2f}-{max(walls):<6.2f} "
              f"{medians[name] / medians[base]:19.2f}x {size / medians[name] / 1e6:6.0f} "
              f"{statistics.median(c for _, _, c in runs):6.2f} {max(r for _, r, _ in runs):9.0f}")
    return medians


# --------------------------------------------------------------------------- in-process stages

# Each stage timed around the functions that do it (summed over calls; convert copies one tensor
# at a time, so the sums add up to its wall time). Printed as one JSON line.
STAGE_CODE = """
import collections, json, os, sys, time
took = collections.Counter()
def timed(owner, attr, stage):
    inner = getattr(owner, attr)
    def wrapper(*args, **kwargs):
        started = time.perf_counter()
        try:
            return inner(*args, **kwargs)
        finally:
            took[stage] += time.perf_counter() - started
    setattr(owner, attr, wrapper)
t0 = time.perf_counter()
from pathlib import Path
from tclip.formats import _io
from tclip.formats.dcp import reader as dcp_reader
from tclip.formats.registry import open_reader
from tclip.work.convert import convert
from tclip.work.statistics import file_statistics
took["imports"] = time.perf_counter() - t0
timed(dcp_reader.DcpReader, "_ensure", "chunk zips")
for name, stage in (("preadv", "read"), ("pwrite", "write"), ("copy_file_range", "kernel copy"), ("fsync", "fsync")):
    timed(os, name, stage)
timed(_io, "start_writeback", "write")
command, source = sys.argv[1], Path(sys.argv[2])
started = time.perf_counter()
if command == "report":
    reader = open_reader(source / ".metadata" if source.is_dir() else source)
    took["open"] = time.perf_counter() - started
    with reader:
        file_statistics(reader)
else:
    convert(source, sys.argv[3])
took[command] = time.perf_counter() - started
print(json.dumps(took))
"""


def stages(runner: Runner, command: str, source: Path, out: Path, repeat: int) -> dict[str, float]:
    """Medians of the in-process stages of ``report`` or ``convert`` of one input."""
    runs = []
    for _ in range(repeat):
        if command == "convert":
            shutil.rmtree(out, ignore_errors=True)
            out.mkdir(parents=True)
            runner.prime(out)
        os.sync()
        done = subprocess.run([sys.executable, "-c", STAGE_CODE, command, str(source), str(out / "converted")],
                              capture_output=True, text=True, check=True)
        runs.append(json.loads(done.stdout.splitlines()[-1]))
    keys = {k for run in runs for k in run}
    return {k: statistics.median(run.get(k, 0.0) for run in runs) for k in sorted(keys)}


def report_parts(wall: float, stage: dict[str, float]) -> dict[str, float]:
    """``report``'s wall time split into the stages of its profile."""
    inside = stage["report"]
    zips = stage.get("chunk zips", 0.0)
    return {"start-up and the rest": max(0.0, wall - inside) + stage["imports"],
            "opening (.metadata, header)": stage["open"], "chunk zips (.pt reader)": zips,
            "pass 1 (read + statistics)": inside - stage["open"] - zips}


def convert_parts(wall: float, stage: dict[str, float]) -> dict[str, float]:
    """``convert``'s wall time split into the stages of its profile."""
    inside = stage["convert"]
    known = {"chunk zips (.pt reader)": stage.get("chunk zips", 0.0), "reading (preadv)": stage.get("read", 0.0),
             "the durable write (copy_file_range, pwrite, fsync)": stage.get("kernel copy", 0.0)
             + stage.get("write", 0.0) + stage.get("fsync", 0.0)}
    return {"start-up and the rest": max(0.0, wall - inside) + stage["imports"], **known,
            "Python between (open, plan, per block)": max(0.0, inside - sum(known.values()))}


def stage_line(label: str, stage: dict[str, float]) -> str:
    return f"  in-process, {label}: " + ", ".join(f"{k} {v:.3f}" for k, v in stage.items()) + " s"


# --------------------------------------------------------------------------- the three parts


def report_section(runner: Runner, files: dict[str, Path], size: int, args: argparse.Namespace) -> list[Target]:
    suite: dict[str, tuple[list[str], Path | None]] = {
        name: ([*TCLIP, "report", "-q", str(path)], None) for name, path in files.items()}
    medians = table("tclip report -q (x safetensors: time, the inverse of throughput)",
                    rounds(runner, suite, args.repeat), "safetensors", size)
    profile = {} if args.no_stages else \
        {name: stages(runner, "report", path, runner.scratch, args.stage_repeat) for name, path in files.items()}
    for name, stage in profile.items():
        print(stage_line(name, stage))
    targets = []
    for name in INPUTS[1:]:
        why = ""
        if profile:
            parts = report_parts(medians[name], profile[name])
            floor = report_parts(medians["safetensors"], profile["safetensors"])
            why = f"{largest(parts, floor)}  [{parts_text(parts)} s; safetensors: {parts_text(floor)} s]"
        targets.append(Target(f"report throughput, {name} / safetensors", medians["safetensors"] / medians[name],
                              0.8, False, why))
    return targets


def convert_section(runner: Runner, files: dict[str, Path], size: int, args: argparse.Namespace,
                    out: Path) -> tuple[list[Target], dict[str, float]]:
    dcp = {name: files[name] for name in INPUTS[1:]}
    suite: dict[str, tuple[list[str], Path | None]] = {
        f"tclip convert, {name}": ([*TCLIP, "convert", "-q", str(path), str(out / name.replace(", ", "-") / "o")],
                                   out / name.replace(", ", "-")) for name, path in dcp.items()}
    suite["dd conv=fsync"] = (["dd", f"if={files['safetensors']}", f"of={out / 'dd' / 'o.safetensors'}", "bs=8M",
                               "conv=fsync", "status=none"], out / "dd")
    if args.torch:
        suite["torch route, DCP, 1 process"] = ([sys.executable, "-c", TORCH_ROUTE, str(files["DCP, 1 process"]),
                                                 str(out / "torch" / "o.safetensors")], out / "torch")
    results = rounds(runner, suite, args.repeat, {"torch route, DCP, 1 process": args.torch_repeat})
    medians = table("DCP -> safetensors (x dd: the same bytes made durable)", results, "dd conv=fsync", size)
    for name, path in dcp.items():  # the last outputs hold the input's tensors, bit for bit
        check(path, out / name.replace(", ", "-") / "o")
    print("  checked: tclip diff of each DCP folder against its conversion says 'same'")
    rss = {name: max(r for _, r, _ in runs) for name, runs in results.items()}
    profile = {} if args.no_stages else \
        {name: stages(runner, "convert", path, out / "stage", args.stage_repeat) for name, path in dcp.items()}
    for name, stage in profile.items():
        print(stage_line(name, stage))
    dd, targets = medians["dd conv=fsync"], []
    for name in dcp:
        wall = medians[f"tclip convert, {name}"]
        parts = convert_parts(wall, profile[name]) if profile else {}
        floor = {"the durable write (copy_file_range, pwrite, fsync)": dd}
        why = f"{largest(parts, floor)}  [{parts_text(parts)}; dd {dd:.2f} s]" if parts else ""
        targets.append(Target(f"convert {name} / dd conv=fsync", wall / dd, 1.5, True, why))
        if profile:  # shown, not judged: where the ratio goes as the checkpoint grows and start-up fades
            targets.append(Target("  the same inside one process (no start-up) / dd", profile[name]["convert"] / dd,
                                  1.5, True, judged=False))
        if "torch route, DCP, 1 process" in medians:
            torch_wall = medians["torch route, DCP, 1 process"]
            why = f"{largest(parts)}  [{parts_text(parts)} s]" if parts else ""
            targets.append(Target(f"torch route / convert {name} (speed)", torch_wall / wall, 2.0, False, why))
            torch_rss = rss["torch route, DCP, 1 process"]
            targets.append(Target(f"convert {name} peak RSS / torch route's", rss[f"tclip convert, {name}"] / torch_rss,
                                  0.25, True, f"{rss[f'tclip convert, {name}']:.0f} of {torch_rss:.0f} MiB"))
    return targets, {name[len("tclip convert, "):]: r for name, r in rss.items() if name.startswith("tclip convert")}


def check(expected: Path, converted: Path) -> None:
    done = subprocess.run([*TCLIP, "diff", str(expected), str(converted)], capture_output=True, text=True)
    if done.returncode != 0 or not any(line.startswith("same:") for line in done.stdout.splitlines()):
        raise SystemExit(f"the conversion {converted} differs from {expected}:\n{done.stdout}{done.stderr}")


def memory_section(runner: Runner, files: dict[str, Path], out: Path, convert_rss: dict[str, float],
                   judged: bool) -> list[Target]:
    """Every command once on each folder; its peak RSS against the default --memory."""
    other = {"DCP, 1 process": files["DCP, 2 ranks"], "DCP, 2 ranks": files["DCP, 1 process"]}
    commands: dict[str, Callable[[Path, str], tuple[list[str], Path | None]]] = {
        "info": lambda p, _: ([*TCLIP, "info", str(p)], None),
        "report": lambda p, _: ([*TCLIP, "report", str(p)], None),
        "report --summary": lambda p, _: ([*TCLIP, "report", "--summary", str(p.parent / "step-*")], None),
        "diff DCP safetensors": lambda p, _: ([*TCLIP, "diff", str(p), str(files["safetensors"])], None),
        "diff DCP DCP": lambda p, name: ([*TCLIP, "diff", str(p), str(other[name])], None),
        "global --out-dir": lambda p, _: ([*TCLIP, "global", "--clip", "1", "-q", "--out-dir", str(out / "clip"),
                                           str(p)], out / "clip"),
        "norm --out-dir": lambda p, _: ([*TCLIP, "norm", "--clip", "1", "-q", "--out-dir", str(out / "clip"),
                                         str(p)], out / "clip"),
    }
    peaks: dict[str, dict[str, float]] = {name: {} for name in commands}
    refused: dict[str, str] = {}
    for command, make in commands.items():
        for name in INPUTS[1:]:
            line, writes = make(files[name], name)
            _, rss, _, error = runner.run(line, writes, ok=(0, 1, 3))
            if error.startswith("Error:"):
                refused[command] = error.strip().splitlines()[0]
                continue
            peaks[command][name] = rss
    peaks["convert"] = convert_rss
    limit = f"{MEMORY_MIB} MiB"
    print(f"\npeak RSS, MiB (default --memory {limit}):")
    targets = []
    for command, by_input in peaks.items():
        if not by_input:
            print(f"  {command:22} not measured: {refused.get(command, '?')}")
            continue
        print(f"  {command:22} " + "   ".join(f"{name} {rss:.0f}" for name, rss in by_input.items()))
        worst = max(by_input, key=lambda k: by_input[k])
        targets.append(Target(f"peak RSS of {command} / {limit}", by_input[worst] / MEMORY_MIB, 1.0, True,
                              f"{by_input[worst]:.0f} MiB on {worst}", judged=judged))
    return targets


# --------------------------------------------------------------------------- main


def arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="a smoke run: 96 MiB, 2 rounds, torch's route once")
    parser.add_argument("--mib", type=int, default=None, help="MiB of tensors (default 512; 96 with --quick)")
    parser.add_argument("--repeat", type=int, default=None, help="timed rounds (default 5; 2 with --quick)")
    parser.add_argument("--torch-repeat", type=int, default=None, help="rounds with torch's route (default 2)")
    parser.add_argument("--stage-repeat", type=int, default=None, help="in-process profile runs (default 3)")
    parser.add_argument("--dir", type=Path, default=Path(tempfile.gettempdir()))
    parser.add_argument("--no-prime", action="store_true",
                        help="no untimed durable write and delete of a scratch copy before each command that writes")
    parser.add_argument("--no-stages", action="store_true", help="skip the in-process profile (no 'held back by')")
    parser.add_argument("--keep", action="store_true", help="keep the checkpoints (and reuse them next time)")
    args = parser.parse_args()
    args.mib = args.mib or (96 if args.quick else 512)
    args.repeat = args.repeat or (2 if args.quick else 5)
    args.torch_repeat = min(args.repeat, args.torch_repeat or (1 if args.quick else 2))
    args.stage_repeat = args.stage_repeat or (1 if args.quick else 3)
    return args


def main() -> None:
    if len(sys.argv) == 4 and sys.argv[1] == "--make":
        make_main(Path(sys.argv[2]), int(sys.argv[3]))
        return
    args = arguments()
    begun = time.perf_counter()
    args.torch = subprocess.run([sys.executable, "-c", "import torch, safetensors.torch"],
                                capture_output=True).returncode == 0
    if not args.torch:
        raise SystemExit("torch is needed to write the DCP folders (pip install torch safetensors)")
    bytecode = compile_tclip()
    root = args.dir / "tclip-bench-dcp" if args.keep else Path(tempfile.mkdtemp(dir=args.dir, prefix="tclip-dcp-"))
    root.mkdir(exist_ok=True)
    try:
        files, writer = make_inputs(root, args.mib)
        size = files["safetensors"].stat().st_size
        runner = Runner(None if args.no_prime else files["safetensors"], root)
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
        print(f"{cores} cores, Python {sys.version.split()[0]}, NumPy {np.__version__}; {size / 2**20:.0f} MiB "
              f"float32 in 16 tensors; DCP written by {writer}; medians of {args.repeat} alternating rounds, "
              f"warm page cache, {'no priming' if args.no_prime else 'disk primed before each write'}; "
              f"load average at start {os.getloadavg()[0]:.2f}")
        print(bytecode)
        targets = report_section(runner, files, size, args)
        more, convert_rss = convert_section(runner, files, size, args, root / "out")
        targets += more
        large = size > MEMORY_MIB << 20
        targets += memory_section(runner, files, root / "out", convert_rss, judged=large)
        print(f"\ntargets (ratios of medians within this run; load average now {os.getloadavg()[0]:.2f}; "
              f"{time.perf_counter() - begun:.0f} s in all):")
        print(f"  {'target':66} {'measured':>8}  {'limit':>8}  verdict")
        print("\n".join(t.row() for t in targets))
        judged = [t for t in targets if t.judged]
        print(f"  {sum(t.met for t in judged)} of {len(judged)} met"
              + ("" if large else f" (memory not judged: {size >> 20} MiB is not more than the {MEMORY_MIB} MiB "
                                  "of --memory)"))
    finally:
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)
        else:
            shutil.rmtree(root / "out", ignore_errors=True)


if __name__ == "__main__":
    os.environ.setdefault("NO_COLOR", "1")
    main()
