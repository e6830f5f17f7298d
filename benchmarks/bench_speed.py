"""tclip against the floor (cp, dd conv=fsync, cat) and the scripts users write, in one run.

    python benchmarks/bench_speed.py [--mib 1024] [--repeat 5] [--dir /tmp]
                                     [--dtypes float32,bfloat16,float16] [--formats safetensors,npz,h5,h5-chunked]
                                     [--torch-python PATH] [--rss] [--stages]

Writes one file per dtype and format (--mib MiB of gradients in 32 tensors), then
runs, in alternating order and with a warm page cache, `cp`, `dd conv=fsync`
(a copy that, like tclip, waits for the disk), `cat FILE >/dev/null`, each tclip
command, the PyTorch script (benchmarks/torch_clip.py: load_file,
get_total_norm, _foreach_mul_, save_file) and the safetensors NumPy API script
(benchmarks/numpy_clip.py). Prints medians, min-max, ratios to cp and to
dd conv=fsync, and peak resident memory per command, one table per file, then
checks the targets of the speed issue. --torch-python runs the PyTorch script
with another interpreter (a virtual environment with torch); without torch it
is skipped with a note.

--rss adds peak memory for a 4-times larger file and for a single tensor of
--mib MiB. --stages times pass 1, the plan and pass 2 inside one process
(the profile that says which stage holds a figure back).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import h5py
import ml_dtypes
import numpy as np
from safetensors import TensorSpec, serialize_file

HERE = Path(__file__).parent
DTYPES = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16, "float16": np.float16}
SAFETENSORS_NAMES = {"float32": "float32", "bfloat16": "bfloat16", "float16": "float16"}


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
                f.create_dataset(name, data=array, chunks=(64, 4096) if kind == "h5-chunked" else None)


# --------------------------------------------------------------------------- running


def run_once(command: list[str], out: Path | None) -> tuple[float, float, int]:
    """(wall seconds, peak RSS MiB, exit status) of one run; its output is thrown away."""
    if out is not None and out.exists():
        out.unlink()
    # cp and the scripts leave their output in the page cache, unwritten; without this the
    # next command's timing would include the kernel writing that back (untimed here).
    os.sync()
    started = time.perf_counter()
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
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
    tclip = [sys.executable, "-m", "tclip"]
    suite = {
        "cp": ["cp", str(path), str(out)],
        "dd conv=fsync": ["dd", f"if={path}", f"of={out}", "bs=8M", "conv=fsync", "status=none"],
        "cat >/dev/null": ["cat", str(path)],
        "tclip global": [*tclip, "global", "--clip", "1", "-q", "--force", "-o", str(out), str(path)],
        "tclip norm": [*tclip, "norm", "--clip", "1", "-q", "--force", "-o", str(out), str(path)],
        "tclip norm --axes 1": [*tclip, "norm", "--clip", "1", "--axes", "1", "-q", "--force", "-o", str(out),
                                str(path)],
        "tclip report": [*tclip, "report", "-q", str(path)],
    }
    if kind == "safetensors" and torch_python:
        suite["PyTorch script"] = [torch_python, str(HERE / "torch_clip.py"), str(path), str(out)]
    if kind == "safetensors" and dtype_name != "bfloat16":
        suite["safetensors NumPy"] = [sys.executable, str(HERE / "numpy_clip.py"), str(path), str(out)]
    return suite


def measure(path: Path, out: Path, suite: dict[str, list[str]], repeat: int) -> dict[str, list[tuple[float, float]]]:
    results: dict[str, list[tuple[float, float]]] = {name: [] for name in suite}
    for name, command in suite.items():  # warm-up: page cache, interpreters
        run_once(command, out if name != "cat >/dev/null" else None)
    for _ in range(repeat):
        for name, command in suite.items():
            wall, rss, _ = run_once(command, out if name not in ("cat >/dev/null", "tclip report") else None)
            results[name].append((wall, rss))
    if out.exists():
        out.unlink()
    return results


def table(title: str, size: int, results: dict[str, list[tuple[float, float]]]) -> dict[str, float]:
    medians = {name: statistics.median(w for w, _ in runs) for name, runs in results.items()}
    cp, dd, cat = medians["cp"], medians["dd conv=fsync"], medians["cat >/dev/null"]
    print(f"\n{title}  ({size / 2**20:.0f} MiB)")
    print(f"{'command':22} {'median s':>9} {'min-max s':>13} {'x cp':>6} {'x dd':>6} {'GB/s':>6} {'peak MiB':>9}")
    for name, runs in results.items():
        walls = [w for w, _ in runs]
        print(f"{name:22} {medians[name]:9.3f} {min(walls):6.2f}-{max(walls):<6.2f} {medians[name] / cp:6.2f} "
              f"{medians[name] / dd:6.2f} {size / medians[name] / 1e9:6.2f} {max(r for _, r in runs):9.0f}")
    return {**medians, "_cat_share": (size / medians["tclip report"]) / (size / cat)}


def check_targets(label: str, medians: dict[str, float], kind: str, dtype_name: str, cores: int) -> list[str]:
    """The speed issue's targets for one file, each as 'ok' or 'MISSED' with the figure."""
    lines = []
    cp, dd = medians["cp"], medians["dd conv=fsync"]

    def target(text: str, ok: bool) -> None:
        lines.append(f"  {'ok    ' if ok else 'MISSED'} {label}: {text}")

    clip_limit = 1.5 if kind in ("safetensors", "npz") else 2.0
    for command in ("tclip global", "tclip norm"):
        target(f"{command} {medians[command] / cp:.2f}x cp (<= {clip_limit})", medians[command] / cp <= clip_limit)
        if kind == "safetensors" and dtype_name == "float32":
            target(f"{command} {medians[command] / dd:.2f}x dd conv=fsync (<= 1.3)", medians[command] / dd <= 1.3)
    axes = medians["tclip norm --axes 1"] / medians["tclip norm"]
    target(f"norm --axes 1 {axes:.2f}x norm (<= 1.2)", axes <= 1.2)
    share = medians["_cat_share"]
    need = 0.5 if cores >= 8 else 0.25
    target(f"report at {share:.0%} of cat's throughput (>= {need:.0%} on {cores} cores)", share >= need)
    if "PyTorch script" in medians:
        ratio = medians["PyTorch script"] / medians["tclip global"]
        target(f"PyTorch script {ratio:.2f}x slower than tclip global (>= 3)", ratio >= 3)
    return lines


# --------------------------------------------------------------------------- memory and stages


def peak_rss(path: Path, out: Path, dtype_name: str) -> float:
    _, rss, _ = run_once([sys.executable, "-m", "tclip", "global", "--clip", "1", "-q", "--force", "-o", str(out),
                          str(path)], out)
    out.unlink(missing_ok=True)
    return rss


def stages(path: Path, out: Path) -> str:
    code = f"""
import time, json
t0 = time.perf_counter()
from tclip.pipeline import file_statistics, make_plan, rewrite_file
from tclip.core.modes import GlobalNormClip
from pathlib import Path
t1 = time.perf_counter()
stats = file_statistics({str(path)!r})
t2 = time.perf_counter()
plan = make_plan(GlobalNormClip(1.0), [stats])
t3 = time.perf_counter()
rewrite_file({str(path)!r}, plan.work[stats.path], None, measure_after=False)
t4 = time.perf_counter()
rewrite_file({str(path)!r}, plan.work[stats.path], Path({str(out)!r}), overwrite=True, measure_after=False)
t5 = time.perf_counter()
print(json.dumps({{"imports": t1 - t0, "pass 1 (read + statistics)": t2 - t1, "plan": t3 - t2,
                  "pass 2 without writing": t4 - t3, "pass 2 (read + scale + write + fsync)": t5 - t4}}))
"""
    runs = []
    for _ in range(3):
        result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
        out.unlink(missing_ok=True)
        runs.append(json.loads(result.stdout))
    return "  ".join(f"{k} {statistics.median(r[k] for r in runs):.3f} s" for k in runs[0])


def main() -> None:
    if len(sys.argv) == 7 and sys.argv[1] == "--make":
        _, _, kind, dtype_name, mib, count, path = sys.argv
        write_file(Path(path), kind, dtype_name, int(mib), int(count))
        return
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mib", type=int, default=1024)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--dir", type=Path, default=Path(tempfile.gettempdir()))
    parser.add_argument("--dtypes", default="float32,bfloat16,float16")
    parser.add_argument("--formats", default="safetensors,npz,h5,h5-chunked")
    parser.add_argument("--torch-python", default=None, help="an interpreter with torch (default: this one, if it has)")
    parser.add_argument("--rss", action="store_true")
    parser.add_argument("--stages", action="store_true")
    parser.add_argument("--keep", action="store_true", help="keep the generated files (and reuse them next time)")
    parser.add_argument("--stages-only", action="store_true", help="only the in-process stage times (medians of 3)")
    args = parser.parse_args()
    torch_python = args.torch_python
    if torch_python is None:
        probe = subprocess.run([sys.executable, "-c", "import torch"], capture_output=True)
        torch_python = sys.executable if probe.returncode == 0 else None
    folder = args.dir / "tclip-bench" if args.keep else Path(tempfile.mkdtemp(dir=args.dir, prefix="tclip-bench-"))
    folder.mkdir(exist_ok=True)
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    print(f"{cores} cores, {os.uname().machine}, Python {sys.version.split()[0]}, NumPy {np.__version__}, "
          f"ml_dtypes {ml_dtypes.__version__}; medians of {args.repeat} alternating runs, warm page cache")
    if torch_python is None:
        print("note: the PyTorch script is skipped (no torch; --torch-python PATH runs it with another interpreter)")
    verdicts = []
    try:
        for dtype_name in args.dtypes.split(","):
            for kind in args.formats.split(","):
                if kind != "safetensors" and dtype_name != "float32":
                    continue  # the other formats are measured on float32 (.npz/HDF5 cannot hold bfloat16)
                path = make_file(folder, kind, dtype_name, args.mib)
                out = folder / f"out{path.suffix}"
                if args.stages_only:
                    print(f"{dtype_name} {kind}: {stages(path, out)}")
                    continue
                suite = commands(path, out, torch_python, dtype_name, kind)
                label = f"{dtype_name} {kind}"
                medians = table(label, path.stat().st_size, measure(path, out, suite, args.repeat))
                verdicts += check_targets(label, medians, kind, dtype_name, cores)
                if args.stages:
                    print(f"  stages of tclip global: {stages(path, out)}")
        if args.rss:
            print("\npeak memory of tclip global (MiB), default --memory 256M:")
            for dtype_name in args.dtypes.split(","):
                many = make_file(folder, "safetensors", dtype_name, 4 * args.mib, count=128)
                one = make_file(folder, "safetensors", dtype_name, args.mib, count=1)
                print(f"  {dtype_name:9} {4 * args.mib} MiB file: {peak_rss(many, folder / 'o.safetensors', dtype_name):6.0f}"
                      f"    one tensor of {args.mib} MiB: {peak_rss(one, folder / 'o.safetensors', dtype_name):6.0f}")
        print("\ntargets:")
        print("\n".join(verdicts))
    finally:
        if not args.keep:
            shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    os.environ.setdefault("NO_COLOR", "1")
    main()
