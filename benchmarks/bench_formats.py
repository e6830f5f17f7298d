"""The same tensors in different formats: does reading a PyTorch file cost what safetensors costs?

    python benchmarks/bench_formats.py [--mib 1024] [--repeat 7] [--dir /tmp] [--commands report,global]
                                       [--torch-clip] [--stage-repeat 3] [--no-prime]

Writes --mib MiB of float32 gradients (32 tensors, rows of 4096) as safetensors and as
a ``torch.save`` file (with torch when it is installed, else with the test suite's
torch-free writer, which lays the zip out as torch does), plus the same .pt with every
tensor saved transposed (``t.t()``: views that are not one run of the file, gathered
piece by piece). Then runs each command on each file in alternating order with a warm
page cache and prints per file the median, the minimum and the maximum wall time, and
the ratio of the .pt's median to the safetensors one.

--torch-clip (needs torch): ``tclip global`` on the .pt against the script a PyTorch
user writes for it (benchmarks/torch_pt_clip.py: torch.load, get_total_norm,
_foreach_mul_, torch.save, fsync) and ``dd conv=fsync`` of the .pt, alternating, each
writing command primed as in bench_speed.py (--no-prime: not), and one target line:
the script's median over tclip's, at least 1.5x, met or MISSED. Beside it, the
in-process profile of tclip on the .pt (pass 1 = the .pt reader + statistics, pass 2
arithmetic = reader + scale, the write = the .pt writer's durable write), and for a
missed target the stage that holds it back (bench_speed.py's profile).
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
TORCH_CLIP_TARGET = 1.5  # the PyTorch script's time over tclip global's, on the same .pt (issue 33)


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


def torch_clip(path: Path, root: Path, repeat: int, stage_repeat: int) -> None:
    """tclip global on the .pt against the PyTorch script on it: the table, the profile, the target line."""
    import bench_speed  # the alternating runs, the priming and the stage profile, shared

    out = root / "clipped.pt"
    suite = {"dd conv=fsync": ["dd", f"if={path}", f"of={out}", "bs=8M", "conv=fsync", "status=none"],
             "tclip global": [*TCLIP, "global", "--clip", "1", "-q", "--force", "-o", str(out), str(path)],
             "PyTorch script": [sys.executable, str(HERE / "torch_pt_clip.py"), str(path), str(out)]}
    results = bench_speed.measure(path, out, suite, repeat)
    walls = {name: [w for w, _ in runs] for name, runs in results.items()}
    medians = {name: statistics.median(values) for name, values in walls.items()}
    print(f"\n.pt global clip against the PyTorch script (torch.load, get_total_norm, _foreach_mul_, "
          f"torch.save, fsync); medians of {repeat}, alternating")
    print(f"{'command':<22} {'median s':>9} {'min':>7} {'max':>7} {'x dd':>6}")
    for name, values in walls.items():
        print(f"{name:<22} {medians[name]:9.3f} {min(values):7.3f} {max(values):7.3f} "
              f"{medians[name] / medians['dd conv=fsync']:6.2f}")
    stage = bench_speed.stages(path, out, "global", stage_repeat)
    parts = bench_speed.clip_parts(medians["tclip global"], stage)
    print(f"  in-process, global on the .pt: {bench_speed.stage_text(stage)} "
          f"(pass 2 with the write {stage['pass 2 with the write']:.2f} s)")
    dd = medians["dd conv=fsync"]
    why = f"{bench_speed.largest(parts, {'the durable write': dd})}  [{bench_speed.parts_text(parts)}; dd {dd:.2f} s]"
    target = bench_speed.Target(".pt: PyTorch script / global", medians["PyTorch script"] / medians["tclip global"],
                                TORCH_CLIP_TARGET, False, why)
    print("\ntarget")
    print(target.row())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=1024)
    parser.add_argument("--repeat", type=int, default=7)
    parser.add_argument("--dir", default=None)
    parser.add_argument("--commands", default="report")
    parser.add_argument("--torch-clip", action="store_true", help="global on the .pt against the PyTorch script")
    parser.add_argument("--stage-repeat", type=int, default=3, help="in-process profile runs (--torch-clip)")
    parser.add_argument("--no-prime", action="store_true", help="no durable copy before each writing command")
    args = parser.parse_args()
    sys.path.insert(0, str(HERE))
    import bench_speed

    print(bench_speed.compile_tclip())
    with tempfile.TemporaryDirectory(dir=args.dir) as folder:
        root = Path(folder)
        data = tensors(args.mib)
        files = {"safetensors": root / "grads.safetensors", "pt": root / "grads.pt",
                 "pt, transposed views": root / "grads_t.pt"}
        save_file(data, str(files["safetensors"]))
        writer = write_pt(files["pt"], data)
        write_pt(files["pt, transposed views"], data, transposed=True)
        if args.torch_clip and not writer.startswith("torch"):
            raise SystemExit("--torch-clip needs torch (the PyTorch script runs with this interpreter)")
        del data
        print(f"{args.mib} MiB float32, 32 tensors; .pt written by {writer}; medians of {args.repeat}")
        if not args.no_prime:
            bench_speed.PRIME["source"] = str(files["pt"])
        for command in filter(None, args.commands.split(",")):
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
        if args.torch_clip:
            torch_clip(files["pt"], root, args.repeat, args.stage_repeat)


if __name__ == "__main__":
    main()
