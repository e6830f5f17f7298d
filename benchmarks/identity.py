"""Byte identity of tclip's outputs across a change that must not change behaviour.

    python benchmarks/identity.py record DIR            # run the matrix with the tclip importable now
    python benchmarks/identity.py compare OLD.json NEW.json

``record`` writes small input files of every format, dtype and layout tclip reads
(npy in C and Fortran order and big-endian, stored and deflated npz, safetensors
with bfloat16/float16/float8/ints, contiguous, chunked and compressed HDF5, a
sharded checkpoint, NaN/Inf, quantized weights), runs every command over them
(norm with and without --axes, average, global, value, report in its forms, info,
diff, dry runs, conversions, the errors users meet) through the click entry
point in this process, and writes DIR/manifest.json: per case the exit status,
stdout and stderr (timings and throughput masked: they are the only figures that
vary between runs) and the sha256 of every file the case wrote.

To check a refactor, record with the old code (``PYTHONPATH=OLD/src``) into one
folder and with the new code into another, then ``compare`` the manifests: any
difference is listed, case by case.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import sys
from pathlib import Path
from typing import Any

import h5py
import ml_dtypes
import numpy as np
from safetensors import TensorSpec, serialize_file

ST_NAMES = {"float64": "float64", "float32": "float32", "float16": "float16", "bfloat16": "bfloat16",
            "float8_e4m3fn": "float8_e4m3fn", "float8_e5m2": "float8_e5m2", "int64": "int64", "int32": "int32",
            "bool": "bool", "uint8": "uint8"}


def write_safetensors(path: Path, tensors: dict[str, np.ndarray], metadata: dict[str, str] | None = None) -> None:
    arrays = {k: np.ascontiguousarray(v) for k, v in tensors.items()}
    specs = {k: TensorSpec(dtype=ST_NAMES[v.dtype.name], shape=list(v.shape), data_ptr=v.ctypes.data,
                           data_len=v.nbytes) for k, v in arrays.items()}
    serialize_file(specs, str(path), metadata=metadata)


def make_inputs(folder: Path) -> None:
    rng = np.random.default_rng(19)

    def normal(shape: tuple[int, ...], scale: float = 1.0) -> np.ndarray:
        return rng.standard_normal(shape) * scale

    folder.mkdir(parents=True)
    np.save(folder / "grads.npy", normal((64, 300), 0.1).astype(np.float32))
    np.save(folder / "half.npy", normal((5, 7, 300), 0.05).astype(np.float16))
    np.save(folder / "fortran.npy", np.asfortranarray(normal((40, 50), 0.2).astype(np.float32)))
    np.save(folder / "bigendian.npy", normal((30, 20), 0.3).astype(">f4"))
    np.save(folder / "double.npy", normal((100,), 0.3))
    np.save(folder / "wide.npy", normal((700, 400), 0.01).astype(np.float32))  # several units
    mixed = {"w": normal((64, 128), 0.05).astype(np.float32), "b": normal((128,), 0.5).astype(np.float32),
             "step": np.array(41200, np.int64), "h": normal((10, 10, 10), 0.1).astype(np.float16),
             "c": (normal((20,)) + 1j * normal((20,))).astype(np.complex64),
             "f": np.asfortranarray(normal((30, 40), 0.1).astype(np.float32))}
    np.savez(folder / "stored.npz", **mixed)
    np.savez_compressed(folder / "deflated.npz", **mixed)
    write_safetensors(folder / "model.safetensors", {
        "layers.0.w": normal((300, 257), 0.02).astype(np.float32),
        "layers.0.b": normal((257,), 0.1).astype(np.float32),
        "layers.1.w": normal((128, 300), 0.02).astype(ml_dtypes.bfloat16),
        "layers.2.w": normal((50, 60), 0.05).astype(np.float16),
        "layers.3.w": normal((32, 32), 0.1).astype(ml_dtypes.float8_e4m3fn),
        "layers.4.w": normal((16, 16), 0.1).astype(ml_dtypes.float8_e5m2),
        "layers.5.w": normal((20, 20)).astype(np.float64),
        "ids": np.arange(5, dtype=np.int64), "mask": np.array([True, False, True])}, {"format": "pt"})
    write_safetensors(folder / "bf16.safetensors", {
        "a": normal((600, 1000), 0.01).astype(ml_dtypes.bfloat16),
        "b": normal((3, 70, 1300), 0.01).astype(ml_dtypes.bfloat16)})
    write_safetensors(folder / "f32.safetensors", {
        "a": normal((1100, 500), 0.01).astype(np.float32), "b": normal((2, 3, 5, 7), 1.0).astype(np.float32),
        "c": np.float32(3.5).reshape(()), "d": np.zeros((0, 4), np.float32)})
    write_safetensors(folder / "f16.safetensors", {
        "a": normal((400, 900), 0.001).astype(np.float16), "b": normal((50,), 10.0).astype(np.float16)})
    bad = normal((10, 10)).astype(np.float32)
    bad[3, 4], bad[7, 1] = np.nan, np.inf
    write_safetensors(folder / "nonfinite.safetensors", {"bad": bad, "good": normal((10,)).astype(np.float32)})
    write_safetensors(folder / "quantized.safetensors", {
        "x.weight": normal((16, 16)).astype(ml_dtypes.float8_e4m3fn),
        "x.weight_scale_inv": np.array([0.5], np.float32), "y.bias": normal((16,)).astype(np.float32)})
    with h5py.File(folder / "model.h5", "w") as f:
        f.attrs["note"] = "tclip identity"
        group = f.create_group("layer")
        group.attrs["units"] = 80
        group.create_dataset("contiguous", data=normal((100, 80), 0.1).astype(np.float32))
        group.create_dataset("gzip", data=normal((200, 64), 0.1).astype(np.float32), chunks=(16, 64),
                             compression="gzip")
        group.create_dataset("chunked", data=normal((64, 64), 0.1).astype(np.float32), chunks=(8, 64))
        group.create_dataset("odd_chunks", data=normal((30, 50), 0.1).astype(np.float64), chunks=(7, 11))
        f.create_dataset("counter", data=np.arange(4, dtype=np.int32))
        f.create_dataset("names", data=np.array([b"a", b"bc"]))
        f.create_dataset("be", data=normal((20, 5), 0.3).astype(">f8"))
        f["layer/contiguous"].attrs["kind"] = "weight"
    with h5py.File(folder / "model.weights.h5", "w") as f:
        f.create_dataset("dense/kernel", data=normal((32, 16), 0.3).astype(np.float32))
        f.create_dataset("dense/bias", data=normal((16,), 0.3).astype(np.float32))
    shards = folder / "ckpt"
    shards.mkdir()
    parts = [{"a.weight": normal((64, 64), 0.1).astype(np.float32), "a.bias": normal((64,)).astype(np.float32)},
             {"b.weight": normal((80, 64), 0.1).astype(ml_dtypes.bfloat16), "step": np.array([3], np.int64)}]
    weight_map = {}
    for i, part in enumerate(parts, 1):
        name = f"model-{i:05d}-of-00002.safetensors"
        write_safetensors(shards / name, part)
        weight_map.update({k: name for k in part})
    (shards / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": sum(v.nbytes for p in parts for v in p.values())}, "weight_map": weight_map},
        indent=2))
    steps = folder / "run"
    steps.mkdir()
    for step in (1, 2, 10):
        tensors = {"w": normal((20, 30), 0.1 * step).astype(np.float32), "b": normal((30,), step).astype(np.float32)}
        if step == 10:
            tensors["w"][0, 0] = np.nan
        write_safetensors(steps / f"step_{step}.safetensors", tensors)


def cases() -> list[tuple[str, list[str]]]:
    files = ["grads.npy", "half.npy", "fortran.npy", "bigendian.npy", "double.npy", "wide.npy", "stored.npz",
             "deflated.npz", "model.safetensors", "bf16.safetensors", "f32.safetensors", "f16.safetensors",
             "model.h5", "model.weights.h5"]
    modes = {
        "norm": ["norm", "--clip", "1"],
        "norm-axes1": ["norm", "--clip", "0.5", "--axes", "1"],
        "norm-axes0": ["norm", "--clip", "0.5", "--axes", "0"],
        "norm-axes-1": ["norm", "--clip", "0.3", "--axes", "-1"],
        "norm-axes01": ["norm", "--clip", "0.2", "--axes", "0,1"],
        "average": ["average", "--clip", "0.0001"],
        "global": ["global", "--clip", "1"],
        "global-use": ["global", "--clip", "1", "--use-norm", "20"],
        "value": ["value", "--min", "-0.05", "--max", "0.05"],
        "value-int": ["value", "--min", "-1", "--max", "2"],
    }
    out: list[tuple[str, list[str]]] = []
    for file in files:
        stem = file.replace(".", "_")
        for mode, args in modes.items():
            out.append((f"{mode}-json-{stem}", [*args, "--json", "--out-dir", f"out/{mode}-json-{stem}", f"in/{file}"]))
            out.append((f"{mode}-text-{stem}", [*args, "--out-dir", f"out/{mode}-text-{stem}", f"in/{file}"]))
        out.append((f"dry-{stem}", ["global", "--clip", "1", "--dry-run", f"in/{file}"]))
        out.append((f"report-json-{stem}", ["report", "--json", f"in/{file}"]))
        out.append((f"report-text-{stem}", ["report", f"in/{file}"]))
        out.append((f"report-stats-{stem}", ["report", "--stats", "--sort", "norm", f"in/{file}"]))
        out.append((f"report-ord1-{stem}", ["report", "--ord", "1", "--json", f"in/{file}"]))
        out.append((f"report-ordinf-{stem}", ["report", "--ord", "inf", f"in/{file}"]))
        out.append((f"report-axes-{stem}", ["report", "--axes", "1", "--json", f"in/{file}"]))
        out.append((f"report-axes-text-{stem}", ["report", "--axes", "1", f"in/{file}"]))
        out.append((f"report-gate-{stem}", ["report", "--max-norm", "1", f"in/{file}"]))
        out.append((f"report-gate-axes-{stem}", ["report", "--max-norm", "0.5", "--axes", "1", "--json", f"in/{file}"]))
        out.append((f"info-{stem}", ["info", f"in/{file}"]))
        out.append((f"info-json-{stem}", ["info", "--json", f"in/{file}"]))
        out.append((f"diff-{stem}", ["diff", f"in/{file}", f"out/global-json-{stem}/{file}"]))
        out.append((f"diff-json-{stem}", ["diff", "--json", "--rtol", "1e-3", f"in/{file}",
                                           f"out/norm-axes1-json-{stem}/{file}"]))
    out += [
        ("convert-npz-st", ["norm", "--clip", "1", "--json", "-o", "out/conv/stored.safetensors", "in/stored.npz"]),
        ("convert-st-h5", ["norm", "--clip", "1", "-o", "out/conv/model.h5", "in/model.safetensors"]),
        ("convert-st-npz", ["norm", "--clip", "1", "--drop-nonnumeric", "-o", "out/conv/f32.npz",
                            "in/f32.safetensors"]),
        ("convert-h5-st", ["global", "--clip", "1", "--drop-nonnumeric", "-o", "out/conv/h5.safetensors",
                           "in/model.h5"]),
        ("convert-h5-st-refused", ["global", "--clip", "1", "-o", "out/conv/h5b.safetensors", "in/model.h5"]),
        ("convert-npy-npz", ["value", "--min", "0", "--max", "0.1", "-o", "out/conv/g.npz", "in/grads.npy"]),
        ("nonfinite-refused", ["norm", "--clip", "1", "--out-dir", "out/nf1", "in/nonfinite.safetensors"]),
        ("nonfinite-propagate", ["global", "--clip", "1", "--nonfinite", "propagate", "--json", "--out-dir",
                                 "out/nf2", "in/nonfinite.safetensors"]),
        ("nonfinite-report", ["report", "in/nonfinite.safetensors"]),
        ("nonfinite-gate", ["report", "--max-norm", "100", "--json", "in/nonfinite.safetensors"]),
        ("strict", ["norm", "--clip", "1", "--axes", "1", "--strict", "--out-dir", "out/strict",
                    "in/model.safetensors"]),
        ("axes-fit-none", ["norm", "--clip", "1", "--axes", "3", "--out-dir", "out/fitnone", "in/grads.npy"]),
        ("quantized-refused", ["global", "--clip", "1", "--out-dir", "out/q", "in/quantized.safetensors"]),
        ("quantized-excluded", ["global", "--clip", "1", "--exclude", "x.*", "--json", "--out-dir", "out/q2",
                                "in/quantized.safetensors"]),
        ("quantized-report", ["report", "in/quantized.safetensors"]),
        ("include", ["norm", "--clip", "0.1", "--include", "layers.1*", "--include", "nothing*", "--json",
                     "--out-dir", "out/inc", "in/model.safetensors"]),
        ("exclude-gate", ["report", "--max-norm", "1", "--exclude", "nothing", "in/model.safetensors"]),
        ("exists-1", ["norm", "--clip", "1", "--out-dir", "out/exists", "in/grads.npy"]),
        ("exists-2", ["norm", "--clip", "1", "--out-dir", "out/exists", "in/grads.npy"]),
        ("exists-force", ["norm", "--clip", "2", "--force", "--out-dir", "out/exists", "in/grads.npy"]),
        ("bad-suffix", ["norm", "--clip", "1", "-o", "out/x.txt", "in/grads.npy"]),
        ("missing", ["report", "in/nothing.npy"]),
        ("glob-none", ["report", "in/*.nothing"]),
        ("many", ["report", "in/grads.npy", "in/half.npy", "in/missing.npz"]),
        ("many-json", ["report", "--json", "in/grads.npy", "in/half.npy", "in/missing.npz"]),
        ("set-global", ["global", "--clip", "1", "--json", "--out-dir", "out/set", "in/ckpt/model.safetensors.index.json"]),
        ("set-global-text", ["global", "--clip", "1", "--out-dir", "out/set-text", "in/ckpt"]),
        ("set-norm-axes", ["norm", "--clip", "0.3", "--axes", "1", "--json", "--out-dir", "out/set-axes",
                           "in/ckpt/model.safetensors.index.json"]),
        ("set-value", ["value", "--min", "-0.1", "--max", "0.1", "--json", "--out-dir", "out/set-value",
                       "in/ckpt/model.safetensors.index.json"]),
        ("set-needs-outdir", ["global", "--clip", "1", "in/ckpt/model.safetensors.index.json"]),
        ("set-report", ["report", "--json", "in/ckpt/model.safetensors.index.json"]),
        ("set-report-text", ["report", "--stats", "in/ckpt"]),
        ("set-info", ["info", "in/ckpt/model.safetensors.index.json"]),
        ("set-info-json", ["info", "--json", "in/ckpt/model.safetensors.index.json"]),
        ("set-diff", ["diff", "in/ckpt", "out/set"]),
        ("set-diff-json", ["diff", "--json", "in/ckpt/model.safetensors.index.json",
                           "out/set/model.safetensors.index.json"]),
        ("across", ["global", "--clip", "1", "--across-files", "--json", "--out-dir", "out/across",
                    "in/run/step_1.safetensors", "in/run/step_2.safetensors"]),
        ("across-report", ["report", "--across-files", "in/run/step_1.safetensors", "in/run/step_2.safetensors"]),
        ("summary", ["report", "--summary", "in/run"]),
        ("summary-json", ["report", "--summary", "--json", "in/run/*.safetensors"]),
        ("summary-gate", ["report", "--summary", "--max-norm", "5", "in/run"]),
        ("diff-map", ["diff", "--map", "layers.*=layers.*", "--sort", "name", "in/model.safetensors",
                      "out/value-json-model_safetensors/model.safetensors"]),
        ("diff-cross", ["diff", "--json", "in/stored.npz", "out/conv/stored.safetensors"]),
        ("diff-quiet", ["diff", "-q", "in/grads.npy", "out/norm-json-grads_npy/grads.npy"]),
        ("diff-same", ["diff", "in/grads.npy", "in/grads.npy"]),
        ("diff-top", ["diff", "--top", "1", "in/model.safetensors", "out/norm-json-model_safetensors/model.safetensors"]),
        ("quiet-clip", ["global", "--clip", "1", "-q", "--out-dir", "out/quiet", "in/model.h5"]),
        ("report-top", ["report", "--top", "2", "--sort", "norm", "in/model.safetensors"]),
        ("report-order", ["report", "--sort", "order", "in/model.h5"]),
        ("info-order", ["info", "--sort", "order", "in/model.h5"]),
    ]
    return out


MASKS = [(re.compile(r"\d+\.\d{3} s\b"), "T s"), (re.compile(r"[\d.]+ (?:B|kB|MB|GB|TB)/s"), "R/s")]


def _no_elapsed(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _no_elapsed(v) for k, v in value.items() if k != "elapsed_s"}
    if isinstance(value, list):
        return [_no_elapsed(v) for v in value]
    return value


def normalized(text: str) -> str:
    lines = []
    for line in text.splitlines():
        if line.startswith("{"):
            try:
                lines.append(json.dumps(_no_elapsed(json.loads(line)), ensure_ascii=False))
                continue
            except ValueError:
                pass
        for pattern, mask in MASKS:
            line = pattern.sub(mask, line)
        lines.append(line)
    return "\n".join(lines)


def digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def snapshot(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): digest(p) for p in sorted(root.rglob("*")) if p.is_file()}


def record(folder: Path) -> None:
    from click.testing import CliRunner

    import tclip
    from tclip.cli import cli

    folder = folder.resolve()
    if folder.exists():
        shutil.rmtree(folder)
    make_inputs(folder / "in")
    os.environ["TCLIP_HDF5_PROBE"] = "0"  # the child check changes no output; it only costs time
    os.chdir(folder)
    (folder / "out").mkdir()
    runner = CliRunner()
    results: dict[str, Any] = {"tclip": str(Path(tclip.__file__).parent), "inputs": snapshot(folder / "in")}
    before: dict[str, str] = {}
    for name, args in cases():
        result = runner.invoke(cli, args, catch_exceptions=False)
        after = snapshot(folder / "out")
        written = {k: v for k, v in after.items() if before.get(k) != v}
        before = after
        results[name] = {"args": args, "exit": result.exit_code, "stdout": normalized(result.stdout),
                         "stderr": normalized(result.stderr), "written": written}
    results["inputs_after"] = snapshot(folder / "in")
    (folder / "manifest.json").write_text(json.dumps(results, indent=1, ensure_ascii=False))
    print(f"{len(results) - 3} cases, {sum(len(r['written']) for k, r in results.items() if isinstance(r, dict) and 'written' in r)} files written"
          f" -> {folder / 'manifest.json'}")


def compare(old_path: Path, new_path: Path) -> int:
    old, new = json.loads(old_path.read_text()), json.loads(new_path.read_text())
    problems = 0
    for key in sorted(set(old) | set(new)):
        if key == "tclip":
            continue
        a, b = old.get(key), new.get(key)
        if a == b:
            continue
        problems += 1
        print(f"DIFFERS: {key}")
        if isinstance(a, dict) and isinstance(b, dict):
            for field in sorted(set(a) | set(b)):
                if a.get(field) != b.get(field):
                    print(f"  {field}:\n    old: {str(a.get(field))[:2000]}\n    new: {str(b.get(field))[:2000]}")
    cases_count = len([k for k in old if k not in ("tclip", "inputs", "inputs_after")])
    files = sum(len(v["written"]) for k, v in old.items() if isinstance(v, dict) and "written" in v)
    print(f"{cases_count} cases, {files} output files: {'identical' if not problems else f'{problems} differ'}")
    return 1 if problems else 0


def main() -> int:
    if len(sys.argv) == 3 and sys.argv[1] == "record":
        record(Path(sys.argv[2]))
        return 0
    if len(sys.argv) == 4 and sys.argv[1] == "compare":
        return compare(Path(sys.argv[2]), Path(sys.argv[3]))
    print(__doc__)
    return 2


if __name__ == "__main__":
    sys.exit(main())
