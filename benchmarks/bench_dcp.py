"""The same tensors as a DCP folder and as one safetensors file: does reading a DCP folder cost
what safetensors costs? (issue target: ``report`` at >= 0.8x the safetensors throughput)

    python benchmarks/bench_dcp.py [--mib 256] [--repeat 5] [--dir /tmp]

Writes --mib MiB of float32 tensors (16 tensors, rows of 2048) as safetensors and, with the real
``torch.distributed.checkpoint`` (torch needed here, never by tclip), as a DCP folder from one
process (every tensor one chunk) and from two gloo ranks (even tensors ``Shard(0)``, odd ones
``Shard(1)``: every tensor two chunks, in two files). Then runs ``tclip report -q`` on each in
alternating order with a warm page cache and prints the median, minimum and maximum wall time and
the ratio of each median to the safetensors one.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

TCLIP = [sys.executable, "-m", "tclip"]


def tensors(mib: int, count: int = 16) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    rows = max(2, (mib << 20) // (count * 2048 * 4))
    return {f"layers.{i}.mlp.weight": rng.standard_normal((rows, 2048), dtype=np.float32) for i in range(count)}


def _rank(rank: int, port: int, source: str, folder: str) -> None:
    import torch
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


def timed(command: list[str]) -> float:
    started = time.perf_counter()
    subprocess.run(command, check=True, stdout=subprocess.DEVNULL)
    return time.perf_counter() - started


def main() -> None:
    from safetensors.numpy import save_file

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=256)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--dir", default=None)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(dir=args.dir) as folder:
        root = Path(folder)
        files = {"safetensors": root / "same.safetensors", "dcp, 1 process": root / "step-1",
                 "dcp, 2 ranks sharded": root / "step-2"}
        save_file(tensors(args.mib), str(files["safetensors"]))
        writer = write_dcp(files["safetensors"], files["dcp, 1 process"], files["dcp, 2 ranks sharded"])
        print(f"{args.mib} MiB float32, 16 tensors; DCP written by {writer}; medians of {args.repeat}")
        times: dict[str, list[float]] = {name: [] for name in files}
        for path in files.values():  # a warm page cache for every input
            timed([*TCLIP, "report", "-q", str(path)])
        for round_ in range(args.repeat):
            order = list(files.items())
            if round_ % 2:
                order.reverse()
            for name, path in order:
                times[name].append(timed([*TCLIP, "report", "-q", str(path)]))
        base = statistics.median(times["safetensors"])
        print(f"\ntclip report\n{'input':<22} {'median s':>9} {'min':>7} {'max':>7} {'vs safetensors':>15}")
        for name, values in times.items():
            median = statistics.median(values)
            print(f"{name:<22} {median:9.3f} {min(values):7.3f} {max(values):7.3f} {median / base:14.2f}x")


if __name__ == "__main__":
    main()
