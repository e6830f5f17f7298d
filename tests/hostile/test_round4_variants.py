"""New cases of the kinds issue 28 (round 4) found, written as its hidden corpora would rerun it.

Each test is a variant the fixes of round 4 could have missed; each failed before its fix.
"""

from __future__ import annotations

import struct
from pathlib import Path

import numpy as np
import support.torch_helpers as th
from support.cli import run

from tclip.formats.torch import archive as _torch_archive



def wrap(path: Path, pickle: bytes, storages: dict[str, bytes]) -> Path:
    """A zip laid out as torch writes it around a hand-made pickle."""
    members = [("data.pkl", pickle), ("byteorder", b"little")]
    members += [(f"data/{key}", data) for key, data in storages.items()]
    members.append(("version", b"3\n"))
    path.write_bytes(th.zip_archive([(f"archive/{name}", data) for name, data in members]))
    return path


def put(index: int) -> bytes:
    return b"r" + struct.pack("<I", index)  # LONG_BINPUT


def get(index: int) -> bytes:
    return b"j" + struct.pack("<I", index)  # LONG_BINGET


STORAGE = {"0": np.ones(4, np.float32).tobytes()}


# --------------------------------------------------------------------------- item 11: name bombs


def distinct_names(count: int) -> bytes:
    """A dict of ``count`` distinct short keys, all naming one tensor: an honest size per name
    (a few bytes each), so only --memory bounds it."""
    tensor = th.tensor_opcodes(th.contiguous("0", (4,)), np.zeros(4, np.float32))
    keys = b"".join(th.text(str(i)) + get(0) for i in range(count))
    return b"\x80\x02" + tensor + put(0) + b"0}(" + keys + b"u."


def test_more_names_than_memory_holds_are_refused_by_the_pickle_reader(tmp_path, monkeypatch):
    """300 000 names in 3 MB under --memory 16M: refused while the pickle is read, before
    its names are walked (before: every key built and walked, 1M of them took 11 s and
    336 MB under --memory 64M, 2M took 18 s and 620 MB under --memory 16M)."""
    path = wrap(tmp_path / "wide.pt", distinct_names(300_000), STORAGE)

    def never(*args, **kwargs):
        raise AssertionError("the names were walked")

    monkeypatch.setattr(_torch_archive, "flatten", never)
    result = run("report", "--memory", "16M", path)
    assert result.exit_code == 1, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"Error: {path}: "), lines
    assert "--memory" in lines[0] and "internal error" not in lines[0]


# --------------------------------------------------------------------------- item 15: norms past float64's range


OVERFLOWING = {  # finite float64 values whose squares sum past 1.8e308: a norm of 3e200, 1.4e300
    "model.layers.17.self_attn.k_proj.weight": np.array([[3e200, 1.0], [2.0, 3.0]]),
    "model.norm.weight": np.array([1e300, 1e300]),
}


def overflowing(tmp_path: Path) -> Path:
    path = tmp_path / "big.npz"
    np.savez(path, **OVERFLOWING)
    return path


def test_a_finite_limit_over_a_norm_that_overflows_writes_no_zeros_or_nan(tmp_path):
    """The norms (3e200, 1.4e300) are below the limits, so README promises the tensors
    unchanged; the sums of squares overflow to inf and, before, norm and average wrote
    zeros, global NaN, all with exit 0. Now: one error naming the tensors, nothing written."""
    path = overflowing(tmp_path)
    for args in (["norm", "--clip", "1e308"], ["average", "--clip", "1e305"], ["global", "--clip", "1e308"],
                 ["norm", "--clip", "1e300", "--axes", "1"]):
        out = tmp_path / "out.npz"
        result = run(*args, "-o", out, path)
        assert result.exit_code == 1, (args, result.output)
        lines = result.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith(f"Error: {path}: "), lines
        assert "model.layers.17.self_attn.k_proj.weight" in lines[0] and "overflow" in lines[0], lines[0]
        assert not out.exists()


def test_an_infinite_limit_or_propagate_still_writes_over_an_overflowing_norm(tmp_path):
    path = overflowing(tmp_path)
    out = tmp_path / "inf.npz"
    result = run("global", "--clip", "inf", "-o", out, path)
    assert result.exit_code == 0, result.output
    with np.load(out) as written:
        for name, values in OVERFLOWING.items():
            assert written[name].tobytes() == values.tobytes()
    out = tmp_path / "tf.npz"
    result = run("norm", "--clip", "1e308", "--nonfinite", "propagate", "-o", out, path)
    assert result.exit_code == 0, result.output  # TensorFlow's arithmetic, asked for: x * c / inf


# --------------------------------------------------------------------------- item 18: Trainer folders


def test_a_sharded_trainer_checkpoint_copies_its_scheduler_and_rng_state(tmp_path):
    """A Trainer's checkpoint-100/ whose model is sharded (an index): scheduler.pt (a plain
    dict of numbers, as LambdaLR.state_dict() saves it) and rng_state.pth (a uint8 RNG state)
    hold no weights, so they are copied into --out-dir for a resumed run; before, both were
    listed 'weights tclip did not clip' and left out. optimizer.pt still is not copied."""
    folder = tmp_path / "checkpoint-100"
    folder.mkdir()
    shards = {"model-00001-of-00002.safetensors": {"model.layers.0.mlp.down_proj.weight": np.full((4, 4), 2.0,
                                                                                                 np.float32)},
              "model-00002-of-00002.safetensors": {"lm_head.weight": np.full((8, 4), 1.0, np.float32)}}
    from support.formats_helpers import safetensors_bytes
    weight_map = {}
    for name, tensors in shards.items():
        (folder / name).write_bytes(safetensors_bytes(tensors))
        weight_map.update({t: name for t in tensors})
    import json
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    (folder / "config.json").write_text("{}")
    th.save_arrays(folder / "optimizer.pt", {"state.0.exp_avg": np.ones(4, np.float32)})
    scheduler = th.text("base_lrs") + b"]G?\x0b\x00\x00\x00\x00\x00\x00a" + th.text("last_epoch") + b"Kd"
    wrap(folder / "scheduler.pt", b"\x80\x02}(" + scheduler + b"u.", {})
    th.save_arrays(folder / "rng_state.pth", {"cpu": np.arange(16, dtype=np.uint8)})
    out = tmp_path / "out"
    result = run("global", "--clip", "1", "--out-dir", out, folder / "model.safetensors.index.json")
    assert result.exit_code == 0, result.output
    copied = sorted(p.name for p in out.iterdir())
    assert "scheduler.pt" in copied and "rng_state.pth" in copied and "config.json" in copied, copied
    assert "optimizer.pt" not in copied
    assert (out / "scheduler.pt").read_bytes() == (folder / "scheduler.pt").read_bytes()


# --------------------------------------------------------------------------- item 2: two runs at once


def test_an_output_named_onto_a_file_another_run_rewrites_in_place_is_refused(tmp_path):
    """An in-place run holds its file's lock; a second run whose -o names that file (--force)
    replaced it anyway (exit 0), so one of the two results was silently lost."""
    from tclip.formats.locks import RunLock

    shard = tmp_path / "model-00002-of-00002.npy"
    np.save(shard, np.ones(4))
    source = tmp_path / "other.npy"
    np.save(source, np.full(4, 5.0))
    before = shard.read_bytes()
    with RunLock(shard):  # what `tclip ... --in-place` holds while it runs
        result = run("norm", "--clip", "1", "-o", shard, "--force", source)
    assert result.exit_code == 1, result.output
    assert "another tclip run" in result.stderr and str(shard) in result.stderr
    assert shard.read_bytes() == before


# --------------------------------------------------------------------------- item 5: negated views


def test_a_negated_view_takes_the_same_row_factors_as_its_base(tmp_path):
    """y and torch._neg_view(y): each row of -y has the norm of y's row, so --axes 1 gives both
    the same factors; before, this was refused as 'would change them differently (2 factors,
    one per slice and 2 factors, one per slice)'. The output is y clipped and its negation."""
    y = np.array([[3.0, 4.0], [0.3, 0.4]], np.float32)
    path = th.save(tmp_path / "neg.pt", {"0": y.reshape(-1)},
                   {"y": th.View("0", 0, (2, 2), (2, 1)), "n": th.View("0", 0, (2, 2), (2, 1), neg=True)})
    out = tmp_path / "out.pt"
    result = run("norm", "--clip", "1", "--axes", "1", "-o", out, path)
    assert result.exit_code == 0, result.output
    from tclip.formats import open_reader
    with open_reader(out) as reader:
        written, negated = reader.read("y"), reader.read("n")
    np.testing.assert_allclose(written, [[0.6, 0.8], [0.3, 0.4]], rtol=1e-6)
    np.testing.assert_array_equal(negated, -written)
