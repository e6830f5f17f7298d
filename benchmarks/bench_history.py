"""What `--plot` adds to `report --summary` (issue 31: at most 2x), and the pictures' sizes.

    python benchmarks/bench_history.py [--files 300] [--tensors 200] [--repeat 3] [--dir /tmp]

Writes FILES tiny safetensors files of TENSORS float32 tensors (4x4, one a spike and
one a NaN somewhere), then times, best of REPEAT, `tclip report --summary -q` alone and
with `--plot` .svg, .html and .png (each a fresh process), and prints the ratios and
the pictures' sizes. A 200 x 1000 grid is drawn in-process for the size limit (5 MB).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from safetensors.numpy import save_file


def best(command: list[str], repeat: int) -> float:
    times = []
    for _ in range(repeat):
        started = time.perf_counter()
        done = subprocess.run(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        if done.returncode not in (0, 3):
            raise SystemExit(f"{' '.join(command)} failed with {done.returncode}")
        times.append(time.perf_counter() - started)
    return min(times)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--files", type=int, default=300)
    parser.add_argument("--tensors", type=int, default=200)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--dir", default=None)
    args = parser.parse_args()
    rng = np.random.default_rng(31)
    with tempfile.TemporaryDirectory(dir=args.dir) as folder:
        run = Path(folder) / "run"
        run.mkdir()
        for step in range(args.files):
            tensors = {f"model.layers.{i // 8}.block.{i % 8}.weight":
                       rng.standard_normal((4, 4)).astype(np.float32) for i in range(args.tensors)}
            if step == args.files // 2:
                tensors["model.layers.3.block.1.weight"] *= 1000
            save_file(tensors, str(run / f"step_{step}.safetensors"))
        base = [sys.executable, "-m", "tclip", "report", "--summary", "-q", str(run)]
        alone = best(base, args.repeat)
        print(f"{args.tensors} tensors x {args.files} files: report --summary -q  {alone:.2f} s")
        for suffix in (".svg", ".html", ".png"):
            out = Path(folder) / f"picture{suffix}"
            took = best([*base, "--plot", str(out)], args.repeat)
            print(f"  --plot {suffix:5s} {took:.2f} s  ({took / alone:.2f}x)  {os.path.getsize(out) / 1e3:.0f} kB")
    from tclip.cli.render.plot import html_picture, svg_picture
    from tclip.work.history import Grid

    rows = [f"model.layers.{i // 8}.block.{i % 8}.weight" for i in range(200)]
    grid = Grid("norms", [f"step_{i}" for i in range(1000)], rows,
                (1 + 0.05 * rng.standard_normal((200, 1000))).tolist())
    labels = grid.columns
    for name, draw in (("svg", svg_picture), ("html", html_picture)):
        started = time.perf_counter()
        text = draw(grid, labels, "bench")
        print(f"200 x 1000 {name}: {len(text.encode()) / 1e6:.2f} MB in {time.perf_counter() - started:.2f} s")


if __name__ == "__main__":
    main()
