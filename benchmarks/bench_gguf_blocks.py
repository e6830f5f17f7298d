"""Speed of tclip's GGUF block arithmetic: closed-form norms against dequantize-then-norm.

    python benchmarks/bench_gguf_blocks.py [--mib 64] [--repeat 5] [--types Q8_0,Q4_K]

For each ggml type, about ``--mib`` MiB of random blocks (random codes and sub-scales,
f16 scales of the size real weights have) are reduced on one core by:

- ``closed``: :func:`tclip.quant.ggml.block_stats` of the whole tensor without
  extremes (sum of squares and sum from integer code sums; F32/F16/BF16: widened values);
- ``+minmax``: the same with the smallest and largest value;
- ``deq+norm``: tclip's own dequantization (ggml's float32 values) in bands of
  2**18 values, widened to float64, squares summed — the road without a closed form;
- ``gguf-py``: the ``gguf`` package's ``quants.dequantize`` plus the same float64 sum
  (the NumPy dequantizer llama.cpp ships), when the package is installed;
- ``scan``: :func:`tclip.quant.ggml.scan_scales` (f16 scales only), in GB/s of blocks;
- ``scale``: :func:`tclip.quant.ggml.scale_blocks` (rewrites the f16 scales).

Figures are M values per second (best of ``--repeat``), single-threaded.
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from tclip.quant import ggml as gb

TYPES = ["F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K"]
BAND = 1 << 18


def random_blocks(type_id: int, mib: float, rng: np.random.Generator) -> np.ndarray:
    """Random blocks whose f16 scales look like a quantized model's (d ~ 1e-4, dmin ~ 8e-4)."""
    info = gb.GGML_TYPES[type_id]
    count = max(1, int(mib * (1 << 20)) // info.block_bytes)
    raw = rng.integers(0, 256, size=(count, info.block_bytes), dtype=np.uint8)
    if type_id in (gb.F32, gb.F16, gb.BF16):
        values = rng.standard_normal(count * info.block_elements).astype(np.float32) * np.float32(0.02)
        dtype = {gb.F32: "<f4", gb.F16: "<f2"}.get(type_id)
        if dtype is None:
            return (values.view(np.uint32) >> np.uint32(16)).astype("<u2").view(np.uint8).reshape(count, -1)
        return values.astype(dtype).view(np.uint8).reshape(count, -1)
    fields = [field for field, _ in info.scale_fields]
    for index, at in enumerate(fields):
        size = 1e-4 if index == 0 else 8e-4
        scales = rng.uniform(0.5 * size, size, count).astype("<f2")
        raw[:, at:at + 2] = scales.view(np.uint8).reshape(count, 2)
    return raw


def best_time(function, repeat: int) -> float:
    best = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        function()
        best = min(best, time.perf_counter() - start)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mib", type=float, default=64.0, help="MiB of blocks per type (default 64)")
    parser.add_argument("--repeat", type=int, default=5, help="runs per figure, the best is shown (default 5)")
    parser.add_argument("--types", default=",".join(TYPES), help="comma-separated type names")
    args = parser.parse_args()
    try:
        from gguf import GGMLQuantizationType
        from gguf import quants as gguf_quants
    except ImportError:
        gguf_quants = None
    by_name = {info.name: info.id for info in gb.GGML_TYPES.values()}
    rng = np.random.default_rng(0)
    print(f"{'type':6} {'MiB':>5} {'closed':>8} {'+minmax':>8} {'deq+norm':>9} {'gguf-py':>8} "
          f"{'scan GB/s':>10} {'scale':>7}   (M values/s, one core)")
    for name in args.types.split(","):
        type_id = by_name[name]
        raw = random_blocks(type_id, args.mib, rng)
        values = raw.shape[0] * gb.GGML_TYPES[type_id].block_elements
        flat = raw.reshape(-1)

        def dequantize_norm() -> float:
            total = 0.0
            for band in gb.dequantize_bands(type_id, flat, max_values=BAND):
                wide = band.astype(np.float64)
                total += float(np.add.reduce(wide * wide))
            return total

        whole = raw.shape[0]
        closed = values / best_time(lambda: gb.block_stats(type_id, flat, group_blocks=whole, extremes=False),
                                    args.repeat) / 1e6
        extremes = values / best_time(lambda: gb.block_stats(type_id, flat, group_blocks=whole), args.repeat) / 1e6
        dequantized = values / best_time(dequantize_norm, args.repeat) / 1e6
        reference = "-"
        if gguf_quants is not None:
            qtype = GGMLQuantizationType(type_id)
            step = max(1, BAND // gb.GGML_TYPES[type_id].block_elements)

            def gguf_norm() -> float:
                total = 0.0
                for start in range(0, raw.shape[0], step):
                    wide = gguf_quants.dequantize(raw[start:start + step], qtype).astype(np.float64)
                    total += float(np.add.reduce(wide.reshape(-1) ** 2))
                return total

            reference = f"{values / best_time(gguf_norm, max(1, args.repeat // 2)) / 1e6:8.0f}"
        scan = raw.nbytes / best_time(lambda: gb.scan_scales(type_id, flat), args.repeat) / 1e9
        scale = "-"
        if gb.can_scale(type_id):
            scale = f"{values / best_time(lambda: gb.scale_blocks(type_id, flat, 0.5), args.repeat) / 1e6:7.0f}"
        print(f"{name:6} {raw.nbytes / (1 << 20):5.0f} {closed:8.0f} {extremes:8.0f} {dequantized:9.0f} "
              f"{reference:>8} {scan:10.1f} {scale:>7}", flush=True)


if __name__ == "__main__":
    main()
