"""tclip against the durable-copy floor (dd conv=fsync) and the scripts users write, in one run.

    python benchmarks/bench_speed.py [--quick] [--mib 1024] [--repeat 5] [--dir /tmp]
                                     [--dtypes float32,bfloat16,float16]
                                     [--formats safetensors,npz,h5,h5-chunked]
                                     [--torch-python PATH] [--rss] [--no-stages] [--no-prime]

Writes one file per dtype and format (--mib MiB of gradients in 32 tensors of
rows of 4096; .npz and HDF5 in float32 only), then runs, in alternating order
and with a warm page cache, `cp`, `dd conv=fsync` (a copy that, like tclip,
waits for the disk), `cat FILE >/dev/null`, each tclip command, and on
safetensors the PyTorch clip script (benchmarks/torch_clip.py: load_file,
get_total_norm, _foreach_mul_, save_file), the PyTorch report script
(benchmarks/torch_report.py: load_file, torch.linalg.vector_norm per tensor)
and the safetensors NumPy API script (benchmarks/numpy_clip.py). Prints
medians, min-max, ratios to cp and to dd conv=fsync and peak resident memory
per command, one table per file; then the start-up of `--help` and shell
completion against `python -c 'import click'`; then one row per target of the
speed issue: the measured ratio, the limit, met or MISSED, and for a missed one
the stage that holds it back.

The stages come from a profile, not a guess: the same work inside one process
(imports, pass 1 = read + statistics, the plan, pass 2 without writing = read +
scale, pass 2 with the durable write), medians of --stage-repeat runs, for
`global`, `norm` and `norm --axes 1`. The write's share is pass 2 with the write
minus pass 2 without it; "start-up and the rest" is the command's wall time
minus the in-process stages (interpreter, imports, the CLI, rendering).

Before each command that writes (dd included), an untimed durable copy of the
input is written beside the output and deleted, so that every such command
writes into blocks a file has just freed (--no-prime: not): on a virtual disk
with online discard, a durable write into blocks freed seconds earlier took
three times as long, and which blocks a command got depended on what ran
before it.

tclip's own modules are compiled to bytecode before anything is timed, as
`pip install` leaves them (an editable install run under PYTHONDONTWRITEBYTECODE
would otherwise compile them from source in every command, while torch and
NumPy load compiled bytecode).

Without torch (neither here nor via --torch-python) the PyTorch rows are
skipped with a note. --rss adds peak memory for a 4-times larger file and for a
single tensor of --mib MiB. --quick: 64 MiB files, 2 runs, 1 stage run (a smoke
run; its figures mean little). The targets' ratios hold on any machine; the
report's share of cat's throughput is judged on 8 or more cores only.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import h5py
import ml_dtypes
import numpy as np
from safetensors import TensorSpec, serialize_file

HERE = Path(__file__).parent
DTYPES = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16, "float16": np.float16}
SAFETENSORS_NAMES = {"float32": "float32", "bfloat16": "bfloat16", "float16": "float16"}
TCLIP = [sys.executable, "-m", "tclip"]
RSS_LIMIT_MIB = 256


# --------------------------------------------------------------------------- files


def tensors(mib: int, dtype: type, count: int = 32, seed: int = 0) -> dict[str, np.ndarray]:
    """``count`` 2-D gradient tensors of ``mib`` MiB in all, rows of 4096 values."""
    rng = np.random.default_rng(seed)
    itemsize = np.dtype(dtype).itemsize
    rows = max(1, mib * (1 << 20) // count // itemsize // 4096)
    return {f"model.layers.{i}.mlp.weight": (rng.standard_normal((rows, 4096), dtype=np.float32) * (i + 1))
            .astype(dtype) for i in range(count)}


def write_safetensors(path: Path, data: dict[str, np.ndarray]) -> None:
    specs = {k: TensorSpec(dtype=SAFETENSORS_NAMES[v.dtype.name], shape=list(v.shape), data_ptr=v.ctypes.data,
                           data_len=v.nbytes) for k, v in data.items()}
    serialize_file(specs, str(path))


def make_file(folder: Path, kind: str, dtype_name: str, mib: int, count: int = 32) -> Path:
    """The file, written by a child process (so this process stays small: a child's peak
    memory as the kernel counts it starts from its parent's at fork)."""
    suffix = {"safetensors": ".safetensors", "npz": ".npz", "h5": ".h5", "h5-chunked": ".h5"}[kind]
    path = folder / f"{dtype_name}-{kind}-{mib}m-{count}{suffix}"
    if not path.exists():
        subprocess.run([sys.executable, __file__, "--make", kind, dtype_name, str(mib), str(count), str(path)],
                       check=True)
    return path


def write_file(path: Path, kind: str, dtype_name: str, mib: int, count: int) -> None:
    dtype = DTYPES[dtype_name]
    data = tensors(mib, dtype, count)
    if kind == "safetensors":
        write_safetensors(path, data)
    elif kind == "npz":
        np.savez(path, **data)
    else:
        with h5py.File(path, "w") as f:
            for name, array in data.items():
                chunks = (min(64, array.shape[0]), 4096) if kind == "h5-chunked" else None
                f.create_dataset(name, data=array, chunks=chunks)


# --------------------------------------------------------------------------- running


PRIME = {"source": None}  # the input to prime with (None: no priming; see prime_disk)


def prime_disk(out: Path) -> None:
    """Untimed, before each command that writes: a durable copy of the input beside ``out``,
    deleted at once, so that every such command (dd included) writes into blocks a file has
    just freed. On the development VM (ext4 mounted with online discard, on a virtual disk)
    a durable 1 GiB write took 0.8-1.0 s into just-freed blocks and 2.9-3.4 s into blocks
    freed seconds earlier; which one a command got depended on what ran before it."""
    if PRIME["source"] is None:
        return
    scratch = out.with_name(out.name + ".prime")
    subprocess.run(["dd", f"if={PRIME['source']}", f"of={scratch}", "bs=8M", "conv=fsync", "status=none"],
                   check=True)
    scratch.unlink()


def run_once(command: list[str], out: Path | None, env: dict[str, str] | None = None) -> tuple[float, float, int]:
    """(wall seconds, peak RSS MiB, exit status) of one run; its output is thrown away."""
    if out is not None and out.exists():
        out.unlink()
    if out is not None:
        prime_disk(out)
    # cp and the scripts leave their output in the page cache, unwritten; without this the
    # next command's timing would include the kernel writing that back (untimed here).
    os.sync()
    started = time.perf_counter()
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env)
    _, status, usage = os.wait4(process.pid, 0)
    wall = time.perf_counter() - started
    process.returncode = os.waitstatus_to_exitcode(status)
    error = process.stderr.read().decode(errors="replace") if process.stderr else ""
    if process.stderr:
        process.stderr.close()
    if process.returncode not in (0, 3):
        raise SystemExit(f"{' '.join(command)} failed ({process.returncode}):\n{error}")
    return wall, usage.ru_maxrss / 1024, process.returncode


def commands(path: Path, out: Path, torch_python: str | None, dtype_name: str, kind: str) -> dict[str, list[str]]:
    clip = ["--clip", "1", "-q", "--force", "-o", str(out)]
    suite = {
        "cp": ["cp", str(path), str(out)],
        "dd conv=fsync": ["dd", f"if={path}", f"of={out}", "bs=8M", "conv=fsync", "status=none"],
        "cat >/dev/null": ["cat", str(path)],
        "tclip global": [*TCLIP, "global", *clip, str(path)],
        "tclip norm": [*TCLIP, "norm", *clip, str(path)],
        "tclip norm --axes 1": [*TCLIP, "norm", "--axes", "1", *clip, str(path)],
        "tclip report": [*TCLIP, "report", "-q", str(path)],
    }
    if kind == "safetensors" and torch_python:
        suite["PyTorch script"] = [torch_python, str(HERE / "torch_clip.py"), str(path), str(out)]
        suite["PyTorch report"] = [torch_python, str(HERE / "torch_report.py"), str(path)]
    if kind == "safetensors" and dtype_name != "bfloat16":
        suite["safetensors NumPy"] = [sys.executable, str(HERE / "numpy_clip.py"), str(path), str(out)]
    return suite


WRITES_NOTHING = ("cat >/dev/null", "tclip report", "PyTorch report")


def measure(path: Path, out: Path, suite: dict[str, list[str]], repeat: int) -> dict[str, list[tuple[float, float]]]:
    results: dict[str, list[tuple[float, float]]] = {name: [] for name in suite}
    for name, command in suite.items():  # warm-up: page cache, interpreters
        run_once(command, None if name in WRITES_NOTHING else out)
    for _ in range(repeat):
        for name, command in suite.items():
            wall, rss, _ = run_once(command, None if name in WRITES_NOTHING else out)
            results[name].append((wall, rss))
    if out.exists():
        out.unlink()
    return results


def table(title: str, size: int, results: dict[str, list[tuple[float, float]]]) -> dict[str, float]:
    """Print one file's table; returns the medians (and the peak RSS of each command as 'rss:NAME')."""
    medians = {name: statistics.median(w for w, _ in runs) for name, runs in results.items()}
    cp, dd = medians["cp"], medians["dd conv=fsync"]
    print(f"\n{title}  ({size / 2**20:.0f} MiB)")
    print(f"{'command':22} {'median s':>9} {'min-max s':>13} {'x cp':>6} {'x dd':>6} {'GB/s':>6} {'peak MiB':>9}")
    for name, runs in results.items():
        walls = [w for w, _ in runs]
        print(f"{name:22} {medians[name]:9.3f} {min(walls):6.2f}-{max(walls):<6.2f} {medians[name] / cp:6.2f} "
              f"{medians[name] / dd:6.2f} {size / medians[name] / 1e9:6.2f} {max(r for _, r in runs):9.0f}")
    return {**medians, **{f"rss:{name}": max(r for _, r in runs) for name, runs in results.items()}}


# --------------------------------------------------------------------------- stages (the profile)


STAGE_CODE = """
import json, sys, time
t0 = time.perf_counter()
from pathlib import Path
from tclip.work.plan import make_plan
from tclip.work.rewrite import rewrite_file
from tclip.work.statistics import file_statistics
from tclip.core.modes import GlobalNormClip, NormClip
t1 = time.perf_counter()
path, out, mode = sys.argv[1], Path(sys.argv[2]), sys.argv[3]
axes = 1 if mode == "axes" else None
stats = file_statistics(path, axes=axes)
t2 = time.perf_counter()
plan = make_plan(GlobalNormClip(1.0) if mode == "global" else NormClip(1.0, axes), [stats])
t3 = time.perf_counter()
rewrite_file(path, plan.work[stats.path], None, axes=axes, measure_after=False)
t4 = time.perf_counter()
rewrite_file(path, plan.work[stats.path], out, axes=axes, overwrite=True, measure_after=False)
t5 = time.perf_counter()
print(json.dumps({"imports": t1 - t0, "pass 1": t2 - t1, "plan": t3 - t2, "pass 2 arithmetic": t4 - t3,
                  "pass 2 with the write": t5 - t4}))
"""


def stages(path: Path, out: Path, mode: str, repeat: int) -> dict[str, float]:
    """Medians of the in-process stages of one clip mode ("global", "norm" or "axes")."""
    runs = []
    for _ in range(repeat):
        prime_disk(out)
        os.sync()
        result = subprocess.run([sys.executable, "-c", STAGE_CODE, str(path), str(out), mode],
                                capture_output=True, text=True, check=True)
        out.unlink(missing_ok=True)
        runs.append(json.loads(result.stdout))
    medians = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
    medians["write"] = max(0.0, medians["pass 2 with the write"] - medians["pass 2 arithmetic"])
    return medians


def stage_text(stage: dict[str, float]) -> str:
    return (f"imports {stage['imports']:.2f}, pass 1 {stage['pass 1']:.2f}, pass 2 arithmetic "
            f"{stage['pass 2 arithmetic']:.2f}, write {stage['write']:.2f} s")


def clip_parts(wall: float, stage: dict[str, float]) -> dict[str, float]:
    """A clip command's wall time split into the stages of the profile."""
    inside = stage["imports"] + stage["pass 1"] + stage["plan"] + stage["pass 2 with the write"]
    return {"start-up and the rest": max(0.0, wall - inside) + stage["imports"],
            "pass 1 (read + statistics)": stage["pass 1"] + stage["plan"],
            "pass 2 arithmetic (read + scale)": stage["pass 2 arithmetic"],
            "the durable write": stage["write"]}


def parts_text(parts: dict[str, float]) -> str:
    return ", ".join(f"{name} {seconds:.2f}" for name, seconds in parts.items())


def largest(parts: dict[str, float], floor: dict[str, float] | None = None) -> str:
    """The part with the most time beyond its floor (what a fix would have to shrink)."""
    floor = floor or {}
    name = max(parts, key=lambda k: parts[k] - floor.get(k, 0.0))
    beyond = f" ({parts[name] - floor[name]:+.2f} s beyond {floor[name]:.2f})" if name in floor else ""
    return f"{name} {parts[name]:.2f} s{beyond}"


# --------------------------------------------------------------------------- start-up


def start_up(repeat: int) -> dict[str, float]:
    """Medians of `python -c 'import click'`, `tclip --help` and shell completion, alternating."""
    completion = dict(os.environ, _TCLIP_COMPLETE="bash_complete", COMP_WORDS="tclip no", COMP_CWORD="1")
    suite = {"python -c 'import click'": ([sys.executable, "-c", "import click"], None),
             "tclip --help": ([*TCLIP, "--help"], None),
             "tclip completion": ([*TCLIP], completion)}
    walls: dict[str, list[float]] = {name: [] for name in suite}
    for _ in range(repeat + 1):
        for name, (command, env) in suite.items():
            walls[name].append(run_once(command, None, env)[0])
    return {name: statistics.median(w[1:]) for name, w in walls.items()}


def heaviest_imports(count: int = 3) -> str:
    """The modules `tclip --help` spends most of its import time in (python -X importtime)."""
    result = subprocess.run([sys.executable, "-X", "importtime", "-m", "tclip", "--help"], capture_output=True,
                            text=True)
    rows = []
    for line in result.stderr.splitlines():
        match = re.match(r"import time:\s+\d+ \|\s+(\d+) \|( *)(\S+)", line)
        if match and len(match.group(2)) <= 1:  # modules imported at the top level
            rows.append((int(match.group(1)), match.group(3)))
    rows.sort(reverse=True)
    return ", ".join(f"{name} {us / 1e3:.0f} ms" for us, name in rows[:count])


# --------------------------------------------------------------------------- targets


@dataclass
class Target:
    what: str
    measured: float
    limit: float
    at_most: bool  # True: measured <= limit is met; False: measured >= limit
    held_back_by: str = ""
    judged: bool = True  # False: shown, not judged (e.g. too few cores)

    @property
    def met(self) -> bool:
        return self.measured <= self.limit if self.at_most else self.measured >= self.limit

    def row(self) -> str:
        verdict = "met" if self.met else "MISSED"
        if not self.judged:
            verdict = "n/a"
        limit = f"{'<=' if self.at_most else '>='} {self.limit:g}x"
        line = f"  {self.what:66} {self.measured:7.2f}x  {limit:>8}  {verdict:6}"
        if not self.met and self.held_back_by:
            line += f"  held back by: {self.held_back_by}"
        return line


def file_targets(label: str, kind: str, dtype_name: str, medians: dict[str, float],
                 profile: dict[str, dict[str, float]], cores: int) -> list[Target]:
    """The speed issue's targets that one file's round can judge."""
    dd = medians["dd conv=fsync"]
    out = []
    # 16-bit safetensors: float32's 1.3x since the 16-bit speed issue (it was 1.5x)
    limit = {"safetensors": 1.3, "npz": 1.3, "h5": 1.5, "h5-chunked": 1.5}[kind]
    for mode in ("global", "norm"):
        wall = medians[f"tclip {mode}"]
        why = ""
        if mode in profile:
            parts = clip_parts(wall, profile[mode])
            why = f"{largest(parts, {'the durable write': dd})}  [{parts_text(parts)}; dd {dd:.2f} s]"
        out.append(Target(f"{label}: {mode} / dd conv=fsync", wall / dd, limit, True, why))
    axes_limit = 1.2 if dtype_name == "float32" else 1.3
    why = ""
    if "axes" in profile and "norm" in profile:
        axes_parts = clip_parts(medians["tclip norm --axes 1"], profile["axes"])
        norm_parts = clip_parts(medians["tclip norm"], profile["norm"])
        why = f"{largest(axes_parts, norm_parts)} against norm  [{parts_text(axes_parts)} s]"
    out.append(Target(f"{label}: norm --axes 1 / norm", medians["tclip norm --axes 1"] / medians["tclip norm"],
                      axes_limit, True, why))
    report = medians["tclip report"]
    report_parts = {"start-up and the rest": report - profile["global"]["pass 1"],
                    "pass 1 (read + statistics)": profile["global"]["pass 1"]} if "global" in profile else {}
    report_why = f"{largest(report_parts)}  [{parts_text(report_parts)} s]" if report_parts else ""
    if "PyTorch script" in medians:
        need = 5.0 if dtype_name == "float32" else 3.0
        why = ""
        if "global" in profile:
            parts = clip_parts(medians["tclip global"], profile["global"])
            why = f"{largest(parts, {'the durable write': dd})}  [{parts_text(parts)}; dd {dd:.2f} s]"
        out.append(Target(f"{label}: PyTorch script / global", medians["PyTorch script"] / medians["tclip global"],
                          need, False, why))
    if "PyTorch report" in medians:
        out.append(Target(f"{label}: PyTorch report script / report", medians["PyTorch report"] / report, 3.0,
                          False, report_why))
    share = medians["cat >/dev/null"] / report
    out.append(Target(f"{label}: report's share of cat's throughput ({cores} cores)", share, 0.5, False,
                      report_why, judged=cores >= 8))
    tclip_rss = {k[4:]: v for k, v in medians.items() if k.startswith("rss:tclip")}
    worst = max(tclip_rss, key=lambda k: tclip_rss[k])
    out.append(Target(f"{label}: peak RSS of {worst} / {RSS_LIMIT_MIB} MiB", tclip_rss[worst] / RSS_LIMIT_MIB,
                      1.0, True, f"{tclip_rss[worst]:.0f} MiB"))
    return out


# --------------------------------------------------------------------------- memory


def peak_rss(path: Path, out: Path) -> float:
    _, rss, _ = run_once([*TCLIP, "global", "--clip", "1", "-q", "--force", "-o", str(out), str(path)], out)
    out.unlink(missing_ok=True)
    return rss


def compile_tclip() -> str:
    """tclip's modules compiled to bytecode first, as ``pip install`` leaves them: from an
    editable install under PYTHONDONTWRITEBYTECODE (or a read-only tree) every run would
    compile every module from source again (0.15 s of a small report's 0.4 s measured),
    while torch, NumPy and click are read from their compiled bytecode."""
    import compileall

    import tclip

    package = Path(tclip.__file__).parent
    compileall.compile_dir(str(package), quiet=1)
    return f"tclip's modules compiled to bytecode first (as pip install leaves them): {package.name}/"


def main() -> None:
    if len(sys.argv) == 7 and sys.argv[1] == "--make":
        _, _, kind, dtype_name, mib, count, path = sys.argv
        write_file(Path(path), kind, dtype_name, int(mib), int(count))
        return
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="a smoke run: 64 MiB files, 2 runs, 1 stage run")
    parser.add_argument("--mib", type=int, default=None, help="MiB per file (default 1024; 64 with --quick)")
    parser.add_argument("--repeat", type=int, default=None, help="alternating runs (default 5; 2 with --quick)")
    parser.add_argument("--stage-repeat", type=int, default=None, help="in-process profile runs (default 3)")
    parser.add_argument("--dir", type=Path, default=Path(tempfile.gettempdir()))
    parser.add_argument("--dtypes", default="float32,bfloat16,float16")
    parser.add_argument("--formats", default="safetensors,npz,h5,h5-chunked")
    parser.add_argument("--torch-python", default=None, help="an interpreter with torch (default: this one, if it has)")
    parser.add_argument("--rss", action="store_true", help="also peak memory on a 4x larger file and one big tensor")
    parser.add_argument("--no-stages", action="store_true", help="skip the in-process profile (no 'held back by')")
    parser.add_argument("--stages", action="store_true", help=argparse.SUPPRESS)  # the default now
    parser.add_argument("--keep", action="store_true", help="keep the generated files (and reuse them next time)")
    parser.add_argument("--stages-only", action="store_true", help="only the in-process stage times")
    parser.add_argument("--no-prime", action="store_true",
                        help="no untimed durable write and delete of a scratch copy before each command that writes")
    args = parser.parse_args()
    mib = args.mib or (64 if args.quick else 1024)
    repeat = args.repeat or (2 if args.quick else 5)
    stage_repeat = args.stage_repeat or (1 if args.quick else 3)
    torch_python = args.torch_python
    candidate = torch_python or sys.executable
    try:
        probe = subprocess.run([candidate, "-c", "import torch, safetensors.torch"], capture_output=True).returncode
    except OSError:
        probe = -1
    if probe != 0:
        if torch_python is not None:
            raise SystemExit(f"--torch-python {torch_python}: cannot import torch and safetensors.torch with it")
        torch_python = None
    else:
        torch_python = candidate
    bytecode = compile_tclip()
    folder = args.dir / "tclip-bench" if args.keep else Path(tempfile.mkdtemp(dir=args.dir, prefix="tclip-bench-"))
    folder.mkdir(exist_ok=True)
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    print(f"{cores} cores, {os.uname().machine}, Python {sys.version.split()[0]}, NumPy {np.__version__}, "
          f"ml_dtypes {ml_dtypes.__version__}; medians of {repeat} alternating runs, warm page cache; "
          f"load average at start {os.getloadavg()[0]:.2f}")
    print(bytecode)
    if torch_python is None:
        print("note: the PyTorch scripts are skipped (no torch; --torch-python PATH runs them with another interpreter)")
    targets: list[Target] = []
    try:
        for dtype_name in args.dtypes.split(","):
            for kind in args.formats.split(","):
                if kind != "safetensors" and dtype_name != "float32":
                    continue  # the other formats are measured on float32 (.npz/HDF5 cannot hold bfloat16)
                path = make_file(folder, kind, dtype_name, mib)
                out = folder / f"out{path.suffix}"
                label = f"{dtype_name} {kind}"
                PRIME["source"] = None if args.no_prime else path
                profile = {} if args.no_stages else \
                    {mode: stages(path, out, mode, stage_repeat) for mode in ("global", "norm", "axes")}
                if args.stages_only:
                    for mode, stage in profile.items():
                        print(f"{label} {mode}: {stage_text(stage)}, plan {stage['plan']:.3f} s")
                    continue
                suite = commands(path, out, torch_python, dtype_name, kind)
                medians = table(label, path.stat().st_size, measure(path, out, suite, repeat))
                for mode, stage in profile.items():
                    print(f"  in-process, {mode}: {stage_text(stage)} (pass 2 with the write "
                          f"{stage['pass 2 with the write']:.2f} s)")
                targets += file_targets(label, kind, dtype_name, medians, profile, cores)
        PRIME["source"] = None  # peak memory and start-up: nothing timed writes
        if args.stages_only:
            return
        timings = start_up(max(5, repeat))
        click = timings["python -c 'import click'"]
        print("\nstart-up (medians): " + ", ".join(f"{k} {v:.3f} s" for k, v in timings.items()))
        heavy = heaviest_imports()
        for name in ("tclip --help", "tclip completion"):
            targets.append(Target(f"{name} / python -c 'import click'", timings[name] / click, 2.0, True,
                                  f"imports: {heavy}"))
        if args.rss:
            print("\npeak memory of tclip global (MiB), default --memory 256M:")
            for dtype_name in args.dtypes.split(","):
                many = make_file(folder, "safetensors", dtype_name, 4 * mib, count=128)
                one = make_file(folder, "safetensors", dtype_name, mib, count=1)
                rss_many, rss_one = peak_rss(many, folder / "o.safetensors"), peak_rss(one, folder / "o.safetensors")
                print(f"  {dtype_name:9} {4 * mib} MiB file: {rss_many:6.0f}    one tensor of {mib} MiB: {rss_one:6.0f}")
                targets.append(Target(f"{dtype_name}: peak RSS, {4 * mib} MiB file / {RSS_LIMIT_MIB} MiB",
                                      rss_many / RSS_LIMIT_MIB, 1.0, True, f"{rss_many:.0f} MiB"))
                targets.append(Target(f"{dtype_name}: peak RSS, one {mib} MiB tensor / {RSS_LIMIT_MIB} MiB",
                                      rss_one / RSS_LIMIT_MIB, 1.0, True, f"{rss_one:.0f} MiB"))
        print(f"\ntargets (ratios of medians within one round; load average now {os.getloadavg()[0]:.2f}):")
        print(f"  {'target':66} {'measured':>8}  {'limit':>8}  verdict")
        print("\n".join(t.row() for t in targets))
        judged = [t for t in targets if t.judged]
        print(f"  {sum(t.met for t in judged)} of {len(judged)} met")
    finally:
        if not args.keep:
            shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    os.environ.setdefault("NO_COLOR", "1")
    main()
