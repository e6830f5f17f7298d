"""How exact are tclip's norms? Relative error against an exact integer computation.

    python benchmarks/bench_norm_accuracy.py [--elements 100000000]

A float32 value is m * 2**e with an integer m of at most 24 bits, so its square
m**2 * 2**(2e) and any sum of squares can be computed exactly with Python
integers. The exact sum is then rounded once to float64; the script prints the
relative error of TensorStats (what every tclip norm uses), of numpy's float64
``np.dot`` and of a float32 ``np.linalg.norm`` for comparison.
"""

from __future__ import annotations

import argparse
import math
import time
from fractions import Fraction

import numpy as np

from tclip.core.stats import TensorStats

CHUNK = 1 << 22


def exact_sum_of_squares(x: np.ndarray) -> Fraction:
    total = 0  # in units of 2**(2 * (MIN_EXP))
    mantissa, exponent = np.frexp(x.astype(np.float32))
    ints = (mantissa * (1 << 24)).astype(np.int64)  # exact: 24-bit mantissas
    shift = exponent.astype(np.int64) - 24  # x = ints * 2**shift
    base = int(shift.min()) if x.size else 0
    for e in np.unique(shift):
        members = ints[shift == e]
        # m**2 < 2**48: sums of 2**14 of them fit in int64
        partial = 0
        for start in range(0, members.size, 1 << 14):
            block = members[start:start + (1 << 14)]
            partial += int(np.sum(block * block))
        total += partial << (2 * (int(e) - base))
    return Fraction(total) * Fraction(2) ** (2 * base)


def relative_error(value: float, exact: Fraction) -> float:
    if exact == 0:
        return abs(value)
    return float(abs(Fraction(value) - exact) / exact)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--elements", type=int, default=100_000_000)
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    n = args.elements
    cases = {
        "normal": lambda: rng.standard_normal(n, dtype=np.float32),
        "mixed magnitudes (1e-6..1e6)": lambda: (rng.standard_normal(n, dtype=np.float32)
                                                 * np.float32(10.0) ** rng.integers(-6, 7, n).astype(np.float32)),
        "constant 0.1": lambda: np.full(n, 0.1, dtype=np.float32),
    }
    print(f"{n:,} float32 elements; relative error of the sum of squares against the exact value")
    print(f"{'case':32} {'tclip':>10} {'np.dot f64':>11} {'f32 norm**2':>12} {'tclip s':>8}")
    for name, make in cases.items():
        x = make()
        exact = exact_sum_of_squares(x)
        started = time.perf_counter()
        ours = TensorStats.of(x).total_sum_of_squares
        elapsed = time.perf_counter() - started
        x64 = x.astype(np.float64)
        naive = float(np.dot(x64, x64))
        del x64
        f32 = float(np.linalg.norm(x)) ** 2
        print(f"{name:32} {relative_error(ours, exact):10.1e} {relative_error(naive, exact):11.1e} "
              f"{relative_error(f32, exact):12.1e} {elapsed:8.2f}")
        if math.isfinite(ours):
            assert relative_error(ours, exact) < 1e-10


if __name__ == "__main__":
    main()
