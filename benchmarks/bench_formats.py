"""The same tensors in different formats: does reading a PyTorch file cost what safetensors costs?

    python benchmarks/bench_formats.py [--mib 1024] [--repeat 7] [--dir /tmp] [--commands report,global]

Writes --mib MiB of float32 gradients (32 tensors, rows of 4096) as safetensors and as
a ``torch.save`` file (with torch when it is installed, else with the test suite's
torch-free writer, which lays the zip out as torch does), plus the same .pt with every
tensor saved transposed (``t.t()``: views that are not one run of the file, gathered
piece by piece). Then runs each command on each file in alternating order with a warm
page cache and prints per file the median, the minimum and the maximum wall time, and
the ratio of the .pt's median to the safetensors one.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from safetensors.numpy import save_file

HERE = Path(__file__).parent
TCLIP = [sys.executable, "-m", "tclip"]


def tensors(mib: int, count: int = 32) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    rows = max(1, mib * (1 << 20) // count // 4 // 4096)
    return {f"model.layers.{i}.mlp.down_proj.weight": rng.standard_normal((rows, 4096), dtype=np.float32) * (i + 1)
            for i in range(count)}


def write_pt(path: Path, data: dict[str, np.ndarray], transposed: bool = False) -> str:
    try:
        import torch
    except ImportError:
        sys.path.insert(0, str(HERE.parent / "tests"))
        from support import torch_helpers

        storages = {str(i): a.reshape(-1) for i, a in enumerate(data.values())}
        views = {}
        for i, (name, a) in enumerate(data.items()):
            rows, cols = a.shape
            views[name] = torch_helpers.View(str(i), 0, (cols, rows), (1, cols)) if transposed \
                else torch_helpers.contiguous(str(i), a.shape)
        torch_helpers.save(path, storages, views)
        return "tests/support/torch_helpers.py"
    state = {name: torch.from_numpy(a) for name, a in data.items()}
    if transposed:
        state = {name: t.t() for name, t in state.items()}
    torch.save(state, path)
    return f"torch {torch.__version__}"


def timed(command: list[str]) -> float:
    started = time.perf_counter()
    subprocess.run(command, check=True, stdout=subprocess.DEVNULL)
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=1024)
    parser.add_argument("--repeat", type=int, default=7)
    parser.add_argument("--dir", default=None)
    parser.add_argument("--commands", default="report")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(dir=args.dir) as folder:
        root = Path(folder)
        data = tensors(args.mib)
        files = {"safetensors": root / "grads.safetensors", "pt": root / "grads.pt",
                 "pt, transposed views": root / "grads_t.pt"}
        save_file(data, str(files["safetensors"]))
        writer = write_pt(files["pt"], data)
        write_pt(files["pt, transposed views"], data, transposed=True)
        del data
        print(f"{args.mib} MiB float32, 32 tensors; .pt written by {writer}; medians of {args.repeat}")
        for command in args.commands.split(","):
            extra = ["--clip", "1", "--force", "-q"] if command != "report" else ["-q"]
            times: dict[str, list[float]] = {name: [] for name in files}
            for name, path in files.items():  # a warm page cache for every file
                timed([*TCLIP, "report", "-q", str(path)])
            for round_ in range(args.repeat):
                order = list(files.items())
                if round_ % 2:
                    order.reverse()
                for name, path in order:
                    output = ["-o", str(root / f"out{path.suffix}")] if command != "report" else []
                    times[name].append(timed([*TCLIP, command, *extra, *output, str(path)]))
            base = statistics.median(times["safetensors"])
            print(f"\ntclip {command}")
            print(f"{'file':<22} {'median s':>9} {'min':>7} {'max':>7} {'vs safetensors':>15}")
            for name, values in times.items():
                median = statistics.median(values)
                print(f"{name:<22} {median:9.3f} {min(values):7.3f} {max(values):7.3f} {median / base:14.2f}x")


if __name__ == "__main__":
    main()
