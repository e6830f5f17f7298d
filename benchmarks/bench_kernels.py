"""Per-element cost of the kernels (tclip.kernels), on one thread and on two at once.

    python benchmarks/bench_kernels.py [--repeat 30] [--dtypes float32,bfloat16,float16]

Each measurement runs a kernel over the 2**18-element units (64 rows of 4096, as
the pipeline cuts a 2-D tensor) of a 16 MiB block of gradient-like values (normal
values, |x| around 3), refreshed before every run so no run finds its data already
scaled; it prints the minimum and the median of --repeat runs in nanoseconds per
element. "two threads" runs the same kernel on two blocks at once, one per thread,
and divides the wall time by the elements of both: with perfect scaling it is half
of the one-thread figure; what is left above that is time spent waiting, mostly for
the GIL between NumPy calls (each kernel call is several NumPy calls, and every call
must take the GIL to start). Load on the machine shows in the medians; the load
average is printed.
"""

from __future__ import annotations

import argparse
import os
import statistics
import threading
import time
from collections.abc import Callable

import ml_dtypes
import numpy as np

from tclip.core.kernels import Scratch, reduce_unit, scale_unit, widen
from tclip.core.units import UNIT_ELEMENTS

DTYPES = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16, "float16": np.float16}
ROWS = 64
UNITS = 8


def block(dtype: type, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return (rng.standard_normal(UNITS * UNIT_ELEMENTS).astype(np.float32) * 3).astype(dtype)


def kernels(dtype: type) -> dict[str, Callable[[np.ndarray, np.ndarray, Scratch], object]]:
    """name -> kernel(unit, row factors, scratch)."""
    return {
        "scale, one factor": lambda unit, factors, scratch: scale_unit(unit, 0.37, scratch),
        "scale, one factor per row": lambda unit, factors, scratch: scale_unit(unit, factors, scratch),
        "widen": lambda unit, factors, scratch: widen(unit, scratch),
        "statistics (pass 1)": lambda unit, factors, scratch: reduce_unit(unit, scratch),
    }


def run(kernel: Callable, work: np.ndarray, factors: np.ndarray, scratch: Scratch) -> None:
    for k in range(UNITS):
        unit = work[k * UNIT_ELEMENTS:(k + 1) * UNIT_ELEMENTS].reshape(ROWS, -1)
        kernel(unit, factors[k * ROWS:(k + 1) * ROWS], scratch)


def one_thread(kernel: Callable, source: np.ndarray, factors: np.ndarray, repeat: int) -> list[float]:
    work, scratch = np.empty_like(source), Scratch()
    times = []
    for _ in range(repeat):
        work[...] = source
        started = time.perf_counter()
        run(kernel, work, factors, scratch)
        times.append((time.perf_counter() - started) / source.size * 1e9)
    return times


def two_threads(kernel: Callable, sources: list[np.ndarray], factors: np.ndarray, repeat: int) -> list[float]:
    works = [np.empty_like(s) for s in sources]
    scratches = [Scratch() for _ in sources]
    times = []
    for _ in range(repeat):
        for work, source in zip(works, sources):
            work[...] = source
        barrier = threading.Barrier(len(sources) + 1)

        def worker(i: int) -> None:
            barrier.wait()
            run(kernel, works[i], factors, scratches[i])

        threads = [threading.Thread(target=worker, args=(i,)) for i in range(len(sources))]
        for thread in threads:
            thread.start()
        barrier.wait()
        started = time.perf_counter()
        for thread in threads:
            thread.join()
        times.append((time.perf_counter() - started) / sum(s.size for s in sources) * 1e9)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeat", type=int, default=30)
    parser.add_argument("--dtypes", default="float32,bfloat16,float16")
    args = parser.parse_args()
    print(f"NumPy {np.__version__}, ml_dtypes {ml_dtypes.__version__}, {os.cpu_count()} CPUs, "
          f"load average {os.getloadavg()[0]:.2f}; ns per element, min / median of {args.repeat}")
    print(f"{'dtype':9} {'kernel':27} {'one thread':>16} {'two threads':>16}")
    factors = 1.0 / (ROWS * 3 * np.random.default_rng(1).uniform(0.5, 2.0, (UNITS * ROWS, 1)))
    for name in args.dtypes.split(","):
        dtype = DTYPES[name]
        sources = [block(dtype, 2), block(dtype, 3)]
        for label, kernel in kernels(dtype).items():
            one = one_thread(kernel, sources[0], factors, args.repeat)
            two = two_threads(kernel, sources, factors, args.repeat)
            print(f"{name:9} {label:27} {min(one):7.2f} / {statistics.median(one):6.2f} "
                  f"{min(two):7.2f} / {statistics.median(two):6.2f}")


if __name__ == "__main__":
    main()
