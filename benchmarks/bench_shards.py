"""A sharded checkpoint clipped by one global norm: serial, local parallel and a Dask cluster.

    python benchmarks/bench_shards.py [--shards 8] [--mib 256] [--repeat 3] [--dir /tmp] [--workers 2]

Writes --shards safetensors shards of --mib MiB of float32 and their index, then
runs `tclip global --clip 1 INDEX --out-dir OUT` serially (--threads 1: one
shard at a time, one thread), in parallel on this machine (the default: shards
and blocks on every core) and on a dask.distributed cluster of --workers
single-threaded workers started on 127.0.0.1 (skipped without the dask extra).
Prints medians and checks that every run wrote the same bytes.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def make(folder: Path, shards: int, mib: int) -> Path:
    code = f"""
import json, numpy as np
from safetensors.numpy import save_file
from pathlib import Path
folder = Path({str(folder)!r}); rng = np.random.default_rng(0); weight_map = {{}}
rows = {mib} * (1 << 20) // 8 // 4 // 4096
for s in range({shards}):
    name = f"model-{{s + 1:05d}}-of-{shards:05d}.safetensors"
    tensors = {{f"model.layers.{{s}}.w{{j}}": rng.standard_normal((rows, 4096), dtype=np.float32) for j in range(8)}}
    save_file(tensors, str(folder / name), metadata={{"format": "pt"}})
    weight_map.update({{k: name for k in tensors}})
(folder / "model.safetensors.index.json").write_text(json.dumps({{"metadata": {{"total_size": 0}},
                                                                  "weight_map": weight_map}}))
"""
    subprocess.run([sys.executable, "-c", code], check=True)
    return folder / "model.safetensors.index.json"


def digest(folder: Path) -> str:
    h = hashlib.sha256()
    for path in sorted(folder.glob("*.safetensors")):
        h.update(path.read_bytes())
    return h.hexdigest()[:16]


def timed(command: list[str], out: Path) -> float:
    shutil.rmtree(out, ignore_errors=True)
    started = time.perf_counter()
    subprocess.run(command, check=True, stdout=subprocess.DEVNULL)
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shards", type=int, default=8)
    parser.add_argument("--mib", type=int, default=256)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--dir", type=Path, default=Path(tempfile.gettempdir()))
    args = parser.parse_args()
    folder = Path(tempfile.mkdtemp(dir=args.dir, prefix="tclip-bench-shards-"))
    cluster = client = None
    try:
        (folder / "ckpt").mkdir()
        index = make(folder / "ckpt", args.shards, args.mib)
        out = folder / "out"
        base = [sys.executable, "-m", "tclip", "global", "--clip", "1", "-q", str(index), "--out-dir", str(out)]
        suite = {"serial (--threads 1)": [*base, "--threads", "1"], "local parallel (default)": base}
        try:
            from dask.distributed import Client, LocalCluster

            cluster = LocalCluster(n_workers=args.workers, threads_per_worker=1, host="127.0.0.1",
                                   dashboard_address=None, silence_logs=50)
            client = Client(cluster)
            suite[f"Dask, {args.workers} workers on 127.0.0.1"] = [*base, "--dask", cluster.scheduler_address,
                                                                   "--threads", "1"]
        except ImportError:
            print("note: the Dask run is skipped (pip install 'tclip[dask]')")
        runs: dict[str, list[float]] = {k: [] for k in suite}
        digests = {}
        for name, command in suite.items():
            timed(command, out)
            digests[name] = digest(out)
        for _ in range(args.repeat):
            for name, command in suite.items():
                runs[name].append(timed(command, out))
        total = sum(p.stat().st_size for p in (folder / "ckpt").glob("*.safetensors"))
        print(f"{os.cpu_count()} cores; {args.shards} shards of {args.mib} MiB ({total / 2**30:.1f} GiB); "
              f"medians of {args.repeat} alternating runs")
        serial = statistics.median(runs["serial (--threads 1)"])
        for name, walls in runs.items():
            median = statistics.median(walls)
            print(f"  {name:34} {median:7.2f} s  ({min(walls):.2f}-{max(walls):.2f})  "
                  f"{serial / median:5.2f}x serial  output {digests[name]}")
        print(f"  same bytes in every run: {'yes' if len(set(digests.values())) == 1 else 'NO'}")
        print(json.dumps({k: statistics.median(v) for k, v in runs.items()}))
    finally:
        if client is not None:
            client.close()
        if cluster is not None:
            cluster.close()
        shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    main()
