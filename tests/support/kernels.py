"""Values and checks the kernel tests share (core/test_same_bits.py, test_kernel_steps.py, test_fused.py)."""

from __future__ import annotations

import math

import ml_dtypes
import numpy as np

from tclip.core.kernels import scale_unit
from tclip.core.modes import apply_scale


def random_values(dtype, n, seed, spread=30):
    """Values across many binades, with zeros, signed zeros and subnormals of the dtype."""
    rng = np.random.default_rng(seed)
    finfo = ml_dtypes.finfo(dtype) if dtype in (ml_dtypes.bfloat16, ml_dtypes.float8_e4m3fn,
                                                ml_dtypes.float8_e5m2) else np.finfo(dtype)
    magnitude = np.exp2(rng.uniform(-spread, min(spread, math.log2(float(finfo.max)) - 1), n))
    values = (rng.choice([-1.0, 1.0], n) * magnitude).astype(dtype)
    values[:: max(1, n // 17)] = 0
    values[1:: max(1, n // 13)] = -0.0
    values[2:: max(1, n // 11)] = np.array(float(finfo.smallest_subnormal), dtype)
    return values


def same_as_reference(x, factor, scratch=None):
    fast = x.copy()
    wide = scale_unit(fast, factor, scratch)
    assert fast.tobytes() == apply_scale(x, factor).tobytes()
    if wide is not None:  # the float64 values handed to the after-statistics are those written
        assert wide.tobytes() == fast.astype(np.float64).tobytes()


# Per-row factors: exact powers of two, factors just under and over 1, float16's largest and subnormal scales.
ROW_FACTORS = [0.2697867137638703, 0.5, 1.0, 2.0, 0.999999, 1e-3, 1e-6, 3.7, 65504 / 3, 2.0 ** -20, 1 / 3,
               0.7071067811865476, 1.0000000000000002, 2.0 ** -14 * 1.5]
