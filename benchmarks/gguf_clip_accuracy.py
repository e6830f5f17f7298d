"""How close a GGUF tensor clipped by rewriting its f16 block scales lands to its target norm.

    python benchmarks/gguf_clip_accuracy.py [--tensors 40]

For each quantized type, ``--tensors`` tensors of 64 x 512 values (Q8_0/Q4_0/Q4_1/Q5_0/Q5_1
quantized from N(0, 0.02) weights by the ``gguf`` package; the K types random blocks with
scales of real weights' size, as in bench_gguf_blocks.py) are rescaled by a factor f drawn
from [0.3, 0.95] with :func:`tclip.quant.ggml.scale_blocks` (what ``norm``/``global``
write) and their exact norms compared: ``after / (f * before) - 1``, its largest magnitude and
its median (as powers of two), and the largest excess above the target.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
from bench_gguf_blocks import random_blocks  # noqa: E402

from tclip.quant import ggml as gb  # noqa: E402

TYPES = ["Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K"]


def norm(type_id: int, raw: np.ndarray) -> float:
    blocks = raw.size // gb.GGML_TYPES[type_id].block_bytes
    return math.sqrt(gb.block_stats(type_id, raw, group_blocks=blocks, extremes=False).sum_of_squares[0])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tensors", type=int, default=40)
    args = parser.parse_args()
    import gguf

    rng = np.random.default_rng(1)
    by_name = {info.name: info.id for info in gb.GGML_TYPES.values()}
    print(f"{'type':5} {'largest |error|':>16} {'median':>8} {'largest excess':>15}")
    for name in TYPES:
        type_id = by_name[name]
        errors = []
        for _ in range(args.tensors):
            if gb.GGML_TYPES[type_id].block_elements == 32:
                weights = (rng.standard_normal((64, 512)) * 0.02).astype(np.float32)
                raw = gguf.quants.quantize(weights, gguf.GGMLQuantizationType(type_id)).reshape(-1)
            else:
                mib = 64 * 512 // 256 * gb.GGML_TYPES[type_id].block_bytes / (1 << 20)
                raw = random_blocks(type_id, mib, rng).reshape(-1)
            factor = rng.uniform(0.3, 0.95)
            errors.append(norm(type_id, gb.scale_blocks(type_id, raw, factor).data) / (factor * norm(type_id, raw)) - 1)
        found = np.array(errors)
        print(f"{name:5} {'2**%.1f' % math.log2(np.abs(found).max()):>16} "
              f"{'2**%.1f' % math.log2(np.median(np.abs(found))):>8} {max(found.max(), 0.0):15.2e}")


if __name__ == "__main__":
    main()
