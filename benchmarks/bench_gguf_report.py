"""Whole-file speed on GGUF: ``tclip report`` of a quantized model against a NumPy
dequantize-then-norm script, and the NaN/Inf scan of the block scales against ``cat``.

    python benchmarks/bench_gguf_report.py [--mib 512] [--types Q8_0,Q4_K] [--repeat 3] [--dir DIR] [--ratios-only]

For each type a GGUF file of about ``--mib`` MiB is written with the ``gguf`` package's
``GGUFWriter`` (4096 x 4096 tensors of random blocks whose f16 scales have the size real
weights' have, as in bench_gguf_blocks.py), then, with the file in the page cache (best of
``--repeat``):

- ``cat``: ``cat FILE > /dev/null``, the floor for reading it;
- ``scan``: :func:`tclip.quant.ggml.scan_scales` over the mapped tensor data, one core
  (what ``report`` adds to find NaN/Inf scales);
- ``report 1``: ``tclip report --threads 1 FILE`` (norms, extremes, NaN/Inf counts,
  the scale scan), one core;
- ``report``: the same on every core;
- ``numpy``: a script that maps the file with the ``gguf`` package's ``GGUFReader`` and, per
  tensor, dequantizes bands of 2**18 values with ``gguf.quants.dequantize`` and sums their
  squares in float64 (one core: NumPy's dequantizer is single-threaded).

Figures: M values per second (GB/s of file for cat and scan) and CPU seconds.

Then, per type, the ratio a loaded machine cannot blur: in one process, alternately, pass 1
of ``report`` (:func:`tclip.work.statistics.file_statistics`, one thread) and the NumPy
script's loop (the same code, run as a function), medians of ``--repeat``, by CPU time and
by wall-clock time, with the target line: every type's ``report`` at least 2x faster than
the script (by CPU time), met or MISSED. ``--ratios-only`` prints these rows alone.
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
from bench_gguf_blocks import random_blocks  # noqa: E402

from tclip.quant import ggml as gb  # noqa: E402

SIDE = 4096
NUMPY_SCRIPT = """
import sys
import numpy as np
from gguf import GGUFReader
from gguf import quants
total = 0.0
for tensor in GGUFReader(sys.argv[1]).tensors:
    rows = tensor.data.reshape(-1, tensor.data.shape[-1])
    step = max(1, (1 << 18) // int(tensor.shape[0]))
    for start in range(0, rows.shape[0], step):
        wide = quants.dequantize(rows[start:start + step], tensor.tensor_type).astype(np.float64)
        total += float(np.add.reduce(wide.reshape(-1) ** 2))
print(total)
"""


def write_model(path: Path, type_id: int, mib: float, rng: np.random.Generator) -> int:
    from gguf import GGMLQuantizationType, GGUFWriter

    info = gb.GGML_TYPES[type_id]
    per_tensor = SIDE * SIDE // info.block_elements * info.block_bytes
    count = max(1, round(mib * (1 << 20) / per_tensor))
    writer = GGUFWriter(str(path), "llama")
    for layer in range(count):
        raw = random_blocks(type_id, per_tensor / (1 << 20), rng).reshape(SIDE, -1)
        writer.add_tensor(f"blk.{layer}.ffn_down.weight", raw, raw_shape=(SIDE, raw.shape[1]),
                          raw_dtype=GGMLQuantizationType(type_id))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return count * SIDE * SIDE


def numpy_script(path: Path) -> float:
    """NUMPY_SCRIPT, in this process: what a user writes with the ``gguf`` package."""
    from gguf import GGUFReader, quants

    total = 0.0
    for tensor in GGUFReader(str(path)).tensors:
        rows = tensor.data.reshape(-1, tensor.data.shape[-1])
        step = max(1, (1 << 18) // int(tensor.shape[0]))
        for start in range(0, rows.shape[0], step):
            wide = quants.dequantize(rows[start:start + step], tensor.tensor_type).astype(np.float64)
            total += float(np.add.reduce(wide.reshape(-1) ** 2))
    return total


def ratio_row(name: str, path: Path, repeat: int) -> float:
    """Print pass 1 against the NumPy script, alternating in this process; the CPU-time ratio."""
    from tclip.work.budget import Budget
    from tclip.work.statistics import file_statistics

    runs: dict[str, list[tuple[float, float]]] = {"tclip": [], "numpy": []}
    jobs = {"tclip": lambda: file_statistics(path, budget=Budget(threads=1)), "numpy": lambda: numpy_script(path)}
    for _ in range(repeat):
        for label, job in jobs.items():
            wall, cpu = time.perf_counter(), time.process_time()
            job()
            runs[label].append((time.perf_counter() - wall, time.process_time() - cpu))
    wall = {k: statistics.median(r[0] for r in v) for k, v in runs.items()}
    cpu = {k: statistics.median(r[1] for r in v) for k, v in runs.items()}
    ratio = cpu["numpy"] / cpu["tclip"]
    print(f"{name:6} pass 1 {cpu['tclip']:.3f} s CPU ({wall['tclip']:.3f} wall)  numpy script {cpu['numpy']:.3f} s CPU "
          f"({wall['numpy']:.3f} wall)  faster: {ratio:.2f}x CPU, {wall['numpy'] / wall['tclip']:.2f}x wall  "
          f"{'met' if ratio >= 2.0 else 'MISSED'}", flush=True)
    return ratio


def timed(command: list[str], repeat: int) -> tuple[float, float]:
    """(best wall seconds, CPU seconds of that run) of a command."""
    best, cpu = float("inf"), 0.0
    for _ in range(repeat):
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        start = time.perf_counter()
        subprocess.run(command, check=True, stdout=subprocess.DEVNULL)
        wall = time.perf_counter() - start
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        if wall < best:
            best, cpu = wall, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return best, cpu


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mib", type=float, default=512.0, help="MiB per file (default 512)")
    parser.add_argument("--types", default="Q8_0,Q4_K", help="comma-separated type names")
    parser.add_argument("--repeat", type=int, default=3, help="runs per figure, the best is shown (default 3)")
    parser.add_argument("--dir", default=None, help="where to write the files (default: a temporary folder)")
    parser.add_argument("--ratios-only", action="store_true", help="only the in-process ratios to the NumPy script")
    args = parser.parse_args()
    by_name = {info.name: info.id for info in gb.GGML_TYPES.values()}
    rng = np.random.default_rng(0)
    print(f"{os.cpu_count()} cores")
    ratios = {}
    with tempfile.TemporaryDirectory(dir=args.dir) as folder:
        for name in args.types.split(","):
            path = Path(folder) / f"model-{name}.gguf"
            values = write_model(path, by_name[name], args.mib, rng)
            if not args.ratios_only:
                command_row(name, path, values, args.repeat)
            ratios[name] = ratio_row(name, path, args.repeat)
            path.unlink()
    print("target: every type's report >= 2x faster than gguf-py dequantize + NumPy (CPU time, one thread): "
          + ", ".join(f"{k} {r:.2f}x {'met' if r >= 2.0 else 'MISSED'}" for k, r in ratios.items()))


def command_row(name: str, path: Path, values: int, repeat: int) -> None:
    """The commands' figures (cat, scan, report on one and every core, the script as a command)."""
    from tclip.formats.gguf.header import parse_gguf

    tclip = [sys.executable, "-m", "tclip"]
    print(f"{'type':6} {'MiB':>5} {'cat GB/s':>9} {'scan GB/s':>10} {'report 1':>9} {'report':>8} {'numpy':>7}"
          f"   (M values/s; CPU s: report 1 / report / numpy)")
    size = path.stat().st_size
    cat, _ = timed(["cat", str(path)], repeat)
    header = parse_gguf(path)
    mapped = np.memmap(path, np.uint8, "r")
    scan = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        for tensor in header.tensors:
            gb.scan_scales(tensor.ggml_type, mapped[tensor.offset:tensor.offset + tensor.nbytes])
        scan = min(scan, time.perf_counter() - start)
    del mapped
    one, one_cpu = timed([*tclip, "report", "--threads", "1", str(path)], repeat)
    every, every_cpu = timed([*tclip, "report", str(path)], repeat)
    with tempfile.NamedTemporaryFile("w", suffix=".py") as script:
        script.write(NUMPY_SCRIPT)
        script.flush()
        numpy_wall, numpy_cpu = timed([sys.executable, script.name, str(path)], max(1, repeat - 1))
    print(f"{name:6} {size / (1 << 20):5.0f} {size / cat / 1e9:9.2f} {size / scan / 1e9:10.2f} "
          f"{values / one / 1e6:9.0f} {values / every / 1e6:8.0f} {values / numpy_wall / 1e6:7.0f}"
          f"   {one_cpu:.1f} / {every_cpu:.1f} / {numpy_cpu:.1f}", flush=True)


if __name__ == "__main__":
    main()
