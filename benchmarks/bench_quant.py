"""Speed of ``tclip report`` on quantized checkpoints against a bfloat16 one of the same size.

    python benchmarks/bench_quant.py [--mib 1024] [--repeat 5] [--threads N] [--dir DIR] [--no-command]

Writes three safetensors files of about ``--mib`` MiB each (32 weights):

- ``bf16/model.safetensors``: bfloat16 weights;
- ``fp8/model.safetensors`` + ``config.json``: the same number of bytes as FP8 codes
  (twice the elements) with DeepSeek-style float32 scales per 128x128 block
  (``weight_scale_inv``), whose norms tclip computes in closed form;
- ``nvfp4/model.safetensors`` + ``config.json``: the same number of bytes of E2M1 codes
  (four times the elements) with ModelOpt NVFP4 scales: E4M3 per 16 codes of a row
  (``weight_scale``) and a float32 global one (``weight_scale_2``);

then times, alternately and with a warm page cache, pass 1 inside one process
(:func:`tclip.work.statistics.file_statistics`, what ``report`` spends its time on) and
the whole command (``python -m tclip report -q``; not with ``--no-command``), and prints
the medians, the bytes per second of each and their ratio to bfloat16's (1.0: the same
bytes per second), by wall-clock time and by CPU time (every thread's; steadier on a busy
machine), and the target line: pass 1 of FP8 and NVFP4 at bfloat16's bytes per second or
more (by CPU time), met or MISSED.
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


def nvfp4_tensors(rng: np.random.Generator, name: str, rows: int, cols: int) -> dict[str, tuple[str, np.ndarray]]:
    """One ModelOpt NVFP4 weight of ``rows`` x ``cols`` codes (``cols / 2`` bytes a row)."""
    scales = rng.integers(0x08, 0x60, (rows, cols // 16), dtype=np.uint8)  # positive, finite E4M3
    return {name: ("U8", rng.integers(0, 256, (rows, cols // 2), dtype=np.uint8)),
            name + "_scale": ("F8_E4M3", scales),
            name + "_scale_2": ("F32", np.asarray(rng.uniform(1e-4, 1e-3), np.float32).reshape(())),
            name.removesuffix("weight") + "input_scale": ("F32", np.asarray(0.01, np.float32).reshape(()))}


NVFP4_CONFIG = {"quantization_config": {
    "quant_method": "modelopt", "quant_algo": "NVFP4", "ignore": ["lm_head"],
    "config_groups": {"group_0": {"weights": {"dynamic": False, "num_bits": 4, "type": "float", "group_size": 16},
                                  "input_activations": {"dynamic": False, "num_bits": 4, "type": "float",
                                                        "group_size": 16}, "targets": ["Linear"]}}}}


def make_files(folder: Path, mib: int) -> dict[str, Path]:
    rng = np.random.default_rng(0)
    per_weight = mib * (1 << 20) // WEIGHTS
    cols = 4096
    bf16_rows = max(128, per_weight // (2 * cols) // 128 * 128)
    fp8_rows = 2 * bf16_rows
    plain, quant, nvfp4 = {}, {}, {}
    for i in range(WEIGHTS):
        name = f"model.layers.{i}.mlp.down_proj.weight"
        values = rng.standard_normal((bf16_rows, cols)).astype(np.float32) * np.float32(0.02)
        plain[name] = ("BF16", values.astype(ml_dtypes.bfloat16))
        codes = rng.integers(0, 256, (fp8_rows, cols), dtype=np.uint8)
        codes[(codes & 0x7F) == 0x7F] = 0  # no NaN codes
        quant[name] = ("F8_E4M3", codes)
        quant[name + "_scale_inv"] = ("F32", rng.uniform(1e-5, 1e-4, (fp8_rows // 128, cols // 128))
                                      .astype(np.float32))
        nvfp4.update(nvfp4_tensors(rng, name, bf16_rows, 4 * cols))
    for kind in ("bf16", "fp8", "nvfp4"):
        (folder / kind).mkdir(exist_ok=True)
    write(folder / "bf16" / "model.safetensors", plain)
    write(folder / "fp8" / "model.safetensors", quant)
    write(folder / "nvfp4" / "model.safetensors", nvfp4)
    (folder / "fp8" / "config.json").write_text(json.dumps({"quantization_config": {
        "quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}}))
    (folder / "nvfp4" / "config.json").write_text(json.dumps(NVFP4_CONFIG))
    return {kind: folder / kind / "model.safetensors" for kind in ("bf16", "fp8", "nvfp4")}


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
    parser.add_argument("--no-command", action="store_true", help="time pass 1 only, not the whole command")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(dir=args.dir) as temp:
        paths = make_files(Path(temp), args.mib)
        sizes = {kind: path.stat().st_size for kind, path in paths.items()}
        for path in paths.values():  # warm the page cache
            path.read_bytes()
        stages = ("pass 1",) if args.no_command else ("pass 1", "report")
        times: dict[str, dict[str, list[tuple[float, float]]]] = {stage: {k: [] for k in paths} for stage in stages}
        for _ in range(args.repeat):
            for label, path in paths.items():
                times["pass 1"][label].append(time_pass(path, args.threads))
                if not args.no_command:
                    times["report"][label].append(time_command(path, args.threads))
        print(f"files: bf16 {sizes['bf16'] / 2**20:.0f} MiB, fp8 (codes + f32 128x128 scales) "
              f"{sizes['fp8'] / 2**20:.0f} MiB, nvfp4 (codes + e4m3 scales per 16 + f32 global) "
              f"{sizes['nvfp4'] / 2**20:.0f} MiB; threads {args.threads or 'all'}; medians of {args.repeat}, "
              "alternating")
        ratios = {}
        for stage, per in times.items():
            for what, which in (("wall", 0), ("CPU", 1)):
                seconds = {k: statistics.median(t[which] for t in v) for k, v in per.items()}
                rates = {k: sizes[k] / seconds[k] for k in seconds}
                print(f"{stage:7s} {what:4s} " + "  ".join(f"{k} {seconds[k]:.3f} s ({rates[k] / 1e9:.2f} GB/s)"
                                                           for k in seconds)
                      + "  bytes/s over bf16's: " + ", ".join(f"{k} {rates[k] / rates['bf16']:.2f}"
                                                             for k in seconds if k != "bf16"))
                if stage == "pass 1" and what == "CPU":
                    ratios = {k: rates[k] / rates["bf16"] for k in rates if k != "bf16"}
        print("target: pass 1 of FP8 and NVFP4 at >= bf16's bytes per second (CPU time): "
              + ", ".join(f"{k} {r:.2f}x {'met' if r >= 1.0 else 'MISSED'}" for k, r in ratios.items()))


if __name__ == "__main__":
    main()
