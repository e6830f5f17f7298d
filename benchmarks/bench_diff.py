"""`tclip diff` against `cmp`, and its peak memory on a file of many tensors larger than --memory.

    python benchmarks/bench_diff.py [--mib 1024] [--repeat 5] [--dir /tmp]

cmp stops at the first differing byte, so the speed ratio is taken on two
identical files (both read whole); the time to compare a file with its clipped
copy (every value differs) is shown beside it. Peak memory is measured on two
files of 400 tensors, each a few units long, with --memory 32M.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def run_once(command: list[str]) -> tuple[float, float]:
    started = time.perf_counter()
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    _, status, usage = os.wait4(process.pid, 0)
    code = os.waitstatus_to_exitcode(status)
    if code not in (0, 1, 3):
        raise SystemExit(f"{' '.join(command)} failed with {code}")
    return time.perf_counter() - started, usage.ru_maxrss / 1024


def write(path: Path, mib: int, count: int, seed: int) -> None:
    code = (f"import numpy as np; from safetensors.numpy import save_file; rng = np.random.default_rng({seed}); "
            f"rows = max(1, {mib} * (1 << 20) // {count} // 4 // 4096); "
            f"save_file({{f'layers.{{i}}.w': rng.standard_normal((rows, 4096), dtype=np.float32) "
            f"for i in range({count})}}, {str(path)!r})")
    subprocess.run([sys.executable, "-c", code], check=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mib", type=int, default=1024)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--dir", type=Path, default=Path(tempfile.gettempdir()))
    args = parser.parse_args()
    folder = Path(tempfile.mkdtemp(dir=args.dir, prefix="tclip-bench-diff-"))
    tclip = [sys.executable, "-m", "tclip"]
    try:
        a, b = folder / "a.safetensors", folder / "b.safetensors"
        write(a, args.mib, 32, 0)
        shutil.copyfile(a, b)
        subprocess.run([*tclip, "global", "--clip", "1", "-q", "-o", str(folder / "c.safetensors"), str(a)], check=True)
        suite = {
            "cmp (identical)": ["cmp", str(a), str(b)],
            "tclip diff (identical)": [*tclip, "diff", "-q", str(a), str(b)],
            "tclip diff (clipped copy)": [*tclip, "diff", "-q", str(a), str(folder / "c.safetensors")],
        }
        runs: dict[str, list[float]] = {k: [] for k in suite}
        for command in suite.values():
            run_once(command)
        for _ in range(args.repeat):
            for name, command in suite.items():
                runs[name].append(run_once(command)[0])
        cmp = statistics.median(runs["cmp (identical)"])
        size = a.stat().st_size
        print(f"{os.cpu_count()} cores; two files of {size / 2**20:.0f} MiB; medians of {args.repeat} alternating runs")
        for name, walls in runs.items():
            median = statistics.median(walls)
            print(f"  {name:28} {median:7.3f} s  ({min(walls):.2f}-{max(walls):.2f})  {median / cmp:5.2f}x cmp  "
                  f"{2 * size / median / 1e9:5.2f} GB/s read")
        ratio = statistics.median(runs["tclip diff (identical)"]) / cmp
        print(f"  target: diff within 2x of cmp: {'ok' if ratio <= 2 else 'MISSED'} ({ratio:.2f}x)")
        many_a, many_b = folder / "many_a.safetensors", folder / "many_b.safetensors"
        write(many_a, 512, 400, 1)
        write(many_b, 512, 400, 2)
        _, rss = run_once([*tclip, "diff", "-q", "--memory", "32M", str(many_a), str(many_b)])
        print(f"  peak memory, two 512 MiB files of 400 tensors, --memory 32M: {rss:.0f} MiB")
    finally:
        shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    main()
