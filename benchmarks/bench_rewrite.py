"""End-to-end speed and peak memory of tclip against `cp`, per format and mode.

    python benchmarks/bench_rewrite.py [--mib 1024] [--repeat 3] [--dir /tmp]

Writes one file per format of about --mib MiB of float32 gradients (many
tensors for .npz/safetensors/HDF5, one 2-D tensor for .npy), then times
`cp` and `tclip <mode> ... -o OUT` on each, warm page cache for both, and
prints medians, the ratio to `cp` and the peak resident memory of each run
(GNU time's %M). `dd conv=fsync` is a copy that, like tclip, waits for the
data to reach the disk. Figures vary on a shared machine: compare within one run.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import h5py
import numpy as np
from safetensors import TensorSpec, serialize_file

TIME = "/usr/bin/time"


def make_files(folder: Path, mib: int) -> dict[str, Path]:
    rng = np.random.default_rng(0)
    tensor_mib = 64
    count = max(1, mib // tensor_mib)
    rows = tensor_mib * (1 << 20) // 4 // 4096
    tensors = {f"layers.{i}.weight": (rng.standard_normal((rows, 4096), dtype=np.float32) * (i + 1))
               for i in range(count)}
    paths = {}
    paths["safetensors"] = folder / "g.safetensors"
    specs = {k: TensorSpec(dtype="float32", shape=list(v.shape), data_ptr=v.ctypes.data, data_len=v.nbytes)
             for k, v in tensors.items()}
    serialize_file(specs, str(paths["safetensors"]))
    paths["npz"] = folder / "g.npz"
    np.savez(paths["npz"], **tensors)
    paths["h5"] = folder / "g.h5"
    with h5py.File(paths["h5"], "w") as f:
        for k, v in tensors.items():
            f.create_dataset(k, data=v, chunks=(256, 4096))
    paths["npy"] = folder / "g.npy"
    np.save(paths["npy"], np.concatenate(list(tensors.values())))
    return paths


def timed(command: list[str]) -> tuple[float, float]:
    """(wall seconds, peak RSS MiB) of one run."""
    result = subprocess.run([TIME, "-f", "%e %M", *command], capture_output=True, text=True)
    if result.returncode != 0:
        raise SystemExit(f"{' '.join(command)} failed:\n{result.stderr}")
    wall, rss_kib = result.stderr.strip().splitlines()[-1].split()
    return float(wall), int(rss_kib) / 1024


def median_run(command: list[str], repeat: int, cleanup: Path) -> tuple[float, float]:
    runs = []
    for _ in range(repeat):
        if cleanup.exists():
            cleanup.unlink()
        runs.append(timed(command))
    return statistics.median(r[0] for r in runs), max(r[1] for r in runs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mib", type=int, default=1024)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--dir", type=Path, default=Path(tempfile.gettempdir()))
    args = parser.parse_args()
    folder = Path(tempfile.mkdtemp(dir=args.dir, prefix="tclip-bench-"))
    try:
        paths = make_files(folder, args.mib)
        tclip = [sys.executable, "-m", "tclip"]
        startup, _ = median_run([*tclip, "--version"], args.repeat, folder / "none")
        print(f"python -m tclip --version: {startup:.2f} s (interpreter and imports, included below)")
        modes = {
            "norm": ["norm", "--clip", "1"],
            "norm --axes 1": ["norm", "--clip", "1", "--axes", "1"],
            "global": ["global", "--clip", "1"],
            "value": ["value", "--min", "-1", "--max", "1"],
            "report": ["report"],
        }
        print(f"{'format':12} {'size':>9} {'mode':14} {'median s':>9} {'x cp':>6} {'GB/s':>6} {'peak MiB':>9}")
        for kind, path in paths.items():
            size = path.stat().st_size
            out = folder / f"out{path.suffix}"
            cp_time, cp_rss = median_run(["cp", str(path), str(out)], args.repeat, out)
            print(f"{kind:12} {size / 2**20:7.0f}Mi {'cp':14} {cp_time:9.2f} {1.0:6.2f} "
                  f"{size / cp_time / 1e9:6.2f} {cp_rss:9.0f}")
            # tclip fsyncs its output before the rename; this is the copy that does too.
            dd_time, dd_rss = median_run(["dd", f"if={path}", f"of={out}", "bs=8M", "conv=fsync", "status=none"],
                                         args.repeat, out)
            print(f"{'':12} {'':9} {'dd conv=fsync':14} {dd_time:9.2f} {dd_time / cp_time:6.2f} "
                  f"{size / dd_time / 1e9:6.2f} {dd_rss:9.0f}")
            for mode, words in modes.items():
                command = [*tclip, *words, "-q", str(path)]
                if mode != "report":
                    command[-1:-1] = ["-o", str(out)]
                seconds, rss = median_run(command, args.repeat, out)
                print(f"{'':12} {'':9} {mode:14} {seconds:9.2f} {seconds / cp_time:6.2f} "
                      f"{size / seconds / 1e9:6.2f} {rss:9.0f}")
    finally:
        shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    os.environ.setdefault("NO_COLOR", "1")
    main()
