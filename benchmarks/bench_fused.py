"""Pass 1's C loop alone (tclip.core._fused.unit_stats), per dtype and per copy of the loops.

    python benchmarks/bench_fused.py [--repeat 15] [--elements-in-cache 32768] [--elements-out 33554432]

For float32, bfloat16 and float16 (gradient-like values, |x| around 3) it prints the
nanoseconds an element of one call over a vector that stays in the cache and over one that
does not, for each copy of the loops the CPU can run (baseline, AVX2, AVX-512, AVX-512 with
BW and FP16: see _fused.set_copies), and the cost per byte of the 16-bit kinds against
float32's; then the target of issue 33 for the copy in use (the highest): 16-bit pass 1 per
byte within 1.2x of float32's, in cache and out of cache, met or MISSED. Times are
the thread's CPU time, the median of --repeat runs with every dtype and copy measured in
turn within each run, so that load from other processes on a shared machine falls on all
alike; the ratios, measured in one run, are the figures to compare. Every copy must give
the same result, bit for bit: the script stops if not.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import ml_dtypes
import numpy as np

from tclip.core import kernels

KINDS = {"float32": (np.float32, 1), "bfloat16": (ml_dtypes.bfloat16, 2), "float16": (np.float16, 3)}
COPIES = {"baseline": 0, "avx2": 1, "avx512": 2, "avx512bw": 3}
CHUNK = 1 << 62  # NumPy 2.x sums a contiguous vector in one call
PER_BYTE_TARGET = 1.2  # 16-bit pass 1 per byte against float32's, at most (issue 33)


def measure(data: dict[str, np.ndarray], levels: dict[str, int], repeat: int) -> dict[tuple[str, str], float]:
    fused = kernels._fused
    per_run = max(1, (1 << 24) // next(iter(data.values())).size)
    times: dict[tuple[str, str], list[float]] = {}
    results: dict[str, set] = {}
    for _ in range(repeat):
        for copy, level in levels.items():
            fused.set_copies(level)
            for name, values in data.items():
                kind = KINDS[name][1]
                started = time.thread_time()
                for _ in range(per_run):
                    result = fused.unit_stats(values, kind, CHUNK)
                elapsed = time.thread_time() - started
                elements = values.size // np.dtype(KINDS[name][0]).itemsize  # values: the bytes
                times.setdefault((copy, name), []).append(elapsed / per_run / elements * 1e9)
                results.setdefault(name, set()).add(result)
    fused.set_copies(3)
    for name, seen in results.items():
        if len(seen) != 1:
            raise SystemExit(f"{name}: the copies disagree: {seen}")
    return {key: statistics.median(value) for key, value in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeat", type=int, default=15)
    parser.add_argument("--elements-in-cache", type=int, default=1 << 15)
    parser.add_argument("--elements-out", type=int, default=1 << 25)
    args = parser.parse_args()
    if kernels._fused is None:
        raise SystemExit("tclip.core._fused is not built")
    levels = {}
    for copy, level in COPIES.items():
        if kernels._fused.set_copies(level) == level:
            levels[copy] = level
    kernels._fused.set_copies(3)
    print(f"NumPy {np.__version__}, {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.2f}; "
          f"ns an element (thread CPU time), median of {args.repeat}")
    rng = np.random.default_rng(0)
    targets: list[str] = []
    for where, size in (("in cache", args.elements_in_cache), ("out of cache", args.elements_out)):
        base = rng.standard_normal(size).astype(np.float32) * 3
        data = {name: base.astype(dtype).view(np.uint8) for name, (dtype, _) in KINDS.items()}
        medians = measure(data, levels, args.repeat)
        for copy in levels:
            f32 = medians[(copy, "float32")]
            figures = "  ".join(f"{name} {medians[(copy, name)]:.3f}" for name in KINDS)
            ratios = "  ".join(f"{name} {medians[(copy, name)] / f32 * 2:.2f}" for name in ("bfloat16", "float16"))
            print(f"{where:12} {copy:8}  {figures}   per byte against float32: {ratios}")
        best = list(levels)[-1]
        for name in ("bfloat16", "float16"):
            ratio = medians[(best, name)] / medians[(best, "float32")] * 2
            verdict = "met" if ratio <= PER_BYTE_TARGET else "MISSED"
            targets.append(f"  {name} pass 1 per byte / float32's, {where}, {best}: {ratio:.2f}x  "
                           f"<= {PER_BYTE_TARGET}x  {verdict}")
    print("\ntargets")
    print("\n".join(targets))


if __name__ == "__main__":
    main()
