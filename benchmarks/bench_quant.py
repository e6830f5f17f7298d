"""Speed of ``tclip report`` on a quantized checkpoint against a bfloat16 one of the same size.

    python benchmarks/bench_quant.py [--mib 1024] [--repeat 5] [--threads N] [--dir DIR]

Writes two safetensors files of about ``--mib`` MiB each (32 weights):

- ``bf16/model.safetensors``: bfloat16 weights;
- ``fp8/model.safetensors`` + ``config.json``: the same number of bytes as FP8 codes
  (twice the elements) with DeepSeek-style float32 scales per 128x128 block
  (``weight_scale_inv``), whose norms tclip computes in closed form;

then times, alternately and with a warm page cache, pass 1 inside one process
(:func:`tclip.work.statistics.file_statistics`, what ``report`` spends its time on) and
the whole command (``python -m tclip report -q``), and prints the medians, the bytes per
second of each and their ratio (fp8 / bf16: 1.0 means the same bytes per second), by
wall-clock time and by CPU time (every thread's; steadier on a busy machine).
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import ml_dtypes
import numpy as np

from tclip.work.budget import Budget
from tclip.work.statistics import file_statistics

WEIGHTS = 32


def write(path: Path, tensors: dict[str, tuple[str, np.ndarray]]) -> None:
    """A safetensors file written directly (raw dtype codes, data in order)."""
    header, offset, blobs = {}, 0, []
    for name, (code, array) in tensors.items():
        data = np.ascontiguousarray(array).tobytes()
        header[name] = {"dtype": code, "shape": list(array.shape), "data_offsets": [offset, offset + len(data)]}
        offset += len(data)
        blobs.append(data)
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    with open(path, "wb") as handle:
        handle.write(len(text).to_bytes(8, "little") + text)
        for blob in blobs:
            handle.write(blob)


def make_files(folder: Path, mib: int) -> tuple[Path, Path]:
    rng = np.random.default_rng(0)
    per_weight = mib * (1 << 20) // WEIGHTS
    cols = 4096
    bf16_rows = max(128, per_weight // (2 * cols) // 128 * 128)
    fp8_rows = 2 * bf16_rows
    plain, quant = {}, {}
    for i in range(WEIGHTS):
        name = f"model.layers.{i}.mlp.down_proj.weight"
        values = rng.standard_normal((bf16_rows, cols)).astype(np.float32) * np.float32(0.02)
        plain[name] = ("BF16", values.astype(ml_dtypes.bfloat16))
        codes = rng.integers(0, 256, (fp8_rows, cols), dtype=np.uint8)
        codes[(codes & 0x7F) == 0x7F] = 0  # no NaN codes
        quant[name] = ("F8_E4M3", codes)
        quant[name + "_scale_inv"] = ("F32", rng.uniform(1e-5, 1e-4, (fp8_rows // 128, cols // 128))
                                      .astype(np.float32))
    (folder / "bf16").mkdir(exist_ok=True)
    (folder / "fp8").mkdir(exist_ok=True)
    write(folder / "bf16" / "model.safetensors", plain)
    write(folder / "fp8" / "model.safetensors", quant)
    (folder / "fp8" / "config.json").write_text(json.dumps({"quantization_config": {
        "quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}}))
    return folder / "bf16" / "model.safetensors", folder / "fp8" / "model.safetensors"


def time_pass(path: Path, threads: int) -> tuple[float, float]:
    """(wall seconds, CPU seconds of every thread) of pass 1 in this process."""
    started, cpu = time.perf_counter(), time.process_time()
    file_statistics(path, budget=Budget(threads=threads))
    return time.perf_counter() - started, time.process_time() - cpu


def time_command(path: Path, threads: int) -> tuple[float, float]:
    """(wall seconds, CPU seconds) of the whole command in a child process."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    started = time.perf_counter()
    extra = ["--threads", str(threads)] if threads else []
    subprocess.run([sys.executable, "-m", "tclip", "report", "-q", *extra, str(path)], check=True)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return time.perf_counter() - started, (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mib", type=int, default=1024)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--threads", type=int, default=0, help="0: every core")
    parser.add_argument("--dir", type=Path, default=None, help="where to write the files (default: a temp dir)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(dir=args.dir) as temp:
        bf16, fp8 = make_files(Path(temp), args.mib)
        sizes = {"bf16": bf16.stat().st_size, "fp8": fp8.stat().st_size}
        for path in (bf16, fp8):  # warm the page cache
            path.read_bytes()
        times: dict[str, dict[str, list[tuple[float, float]]]] = {"pass 1": {"bf16": [], "fp8": []},
                                                                   "report": {"bf16": [], "fp8": []}}
        for _ in range(args.repeat):
            for label, path in (("bf16", bf16), ("fp8", fp8)):
                times["pass 1"][label].append(time_pass(path, args.threads))
                times["report"][label].append(time_command(path, args.threads))
        print(f"files: bf16 {sizes['bf16'] / 2**20:.0f} MiB, fp8 (codes + f32 128x128 scales) "
              f"{sizes['fp8'] / 2**20:.0f} MiB; threads {args.threads or 'all'}; medians of {args.repeat}")
        for stage, per in times.items():
            for what, which in (("wall", 0), ("CPU", 1)):
                seconds = {k: statistics.median(t[which] for t in v) for k, v in per.items()}
                rates = {k: sizes[k] / seconds[k] for k in seconds}
                print(f"{stage:7s} {what:4s} bf16 {seconds['bf16']:.3f} s ({rates['bf16'] / 1e9:.2f} GB/s)  "
                      f"fp8 {seconds['fp8']:.3f} s ({rates['fp8'] / 1e9:.2f} GB/s)  "
                      f"fp8/bf16 bytes per second: {rates['fp8'] / rates['bf16']:.2f}")


if __name__ == "__main__":
    main()
