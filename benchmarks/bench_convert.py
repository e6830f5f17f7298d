"""DCP -> safetensors: ``tclip convert`` against the way users do it today and against ``dd``.

    python benchmarks/bench_convert.py [--mib 512] [--repeat 3] [--dir /tmp]

Writes --mib MiB of float32 tensors (16 tensors, rows of 2048) as a DCP folder with the real
``torch.distributed.checkpoint`` (one process, and two gloo ranks with every tensor sharded: see
bench_dcp.py), then, in alternating order, each a fresh process whose peak RSS GNU time
reads:

- ``tclip convert FOLDER OUT/`` (default ``--memory 256M``, below the checkpoint's size);
- ``dcp_to_torch_save`` + ``torch.load`` + ``safetensors.torch.save_file`` (torch's own route);
- ``dd bs=8M conv=fsync`` of a safetensors file of the same bytes (the disk's cost).

Issue targets: convert within 1.5x dd, >= 2x faster than torch's route, <= 1/4 of its peak memory.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_dcp import tensors, write_dcp  # noqa: E402

TORCH_ROUTE = """
import sys, torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
from safetensors.torch import save_file
dcp_to_torch_save(sys.argv[1], sys.argv[2] + ".pt")
state = torch.load(sys.argv[2] + ".pt", weights_only=True)
save_file({k: v.contiguous() for k, v in state.items()}, sys.argv[2])
"""


def measured(command: list[str], report: Path) -> tuple[float, int]:
    """(wall seconds, peak RSS in bytes) of one fresh process. GNU time reads the RSS: a child
    forked from this process would count this one's pages (torch, the tensors) as its own."""
    started = time.perf_counter()
    done = subprocess.run(["/usr/bin/time", "-f", "%M", "-o", str(report), *command], stdout=subprocess.DEVNULL,
                          stderr=subprocess.PIPE)
    elapsed = time.perf_counter() - started
    if done.returncode != 0:
        raise SystemExit(f"{command[:3]} failed: {done.stderr.decode()}")
    return elapsed, int(report.read_text().split()[-1]) * 1024


def main() -> None:
    from safetensors.numpy import save_file

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=512)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--dir", default=None)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(dir=args.dir) as folder:
        root = Path(folder)
        source = root / "same.safetensors"
        save_file(tensors(args.mib), str(source))
        single, ranks = root / "step-1", root / "step-2"
        writer = write_dcp(source, single, ranks)
        out = root / "out"
        routes = {
            "tclip convert, 1 process": lambda: [sys.executable, "-m", "tclip", "convert", "-q", str(single),
                                                 str(out / "tclip1")],
            "tclip convert, 2 ranks": lambda: [sys.executable, "-m", "tclip", "convert", "-q", str(ranks),
                                               str(out / "tclip2")],
            "torch dcp_to_torch_save": lambda: [sys.executable, "-c", TORCH_ROUTE, str(single),
                                                str(out / "torch.safetensors")],
            "dd conv=fsync": lambda: ["dd", f"if={source}", f"of={out / 'dd.safetensors'}", "bs=8M", "conv=fsync",
                                      "status=none"],
        }
        print(f"{args.mib} MiB float32, 16 tensors; DCP written by {writer}; medians of {args.repeat}, "
              "each a fresh process (page cache warm)")
        results: dict[str, list[tuple[float, int]]] = {name: [] for name in routes}
        for round_ in range(args.repeat + 1):  # the first round warms the page cache, not counted
            order = list(routes.items())
            if round_ % 2:
                order.reverse()
            for name, command in order:
                shutil.rmtree(out, ignore_errors=True)
                out.mkdir()
                outcome = measured(command(), root / "time.txt")
                if round_:
                    results[name].append(outcome)
        dd = statistics.median(t for t, _ in results["dd conv=fsync"])
        torch_time = statistics.median(t for t, _ in results["torch dcp_to_torch_save"])
        torch_rss = max(r for _, r in results["torch dcp_to_torch_save"])
        print(f"\n{'route':<26} {'median s':>9} {'vs dd':>7} {'torch/this':>11} {'peak RSS MiB':>13} {'/torch':>7}")
        for name, values in results.items():
            median = statistics.median(t for t, _ in values)
            rss = max(r for _, r in values)
            print(f"{name:<26} {median:9.3f} {median / dd:6.2f}x {torch_time / median:10.2f}x "
                  f"{rss / 2**20:13.0f} {rss / torch_rss:7.2f}")


if __name__ == "__main__":
    main()
