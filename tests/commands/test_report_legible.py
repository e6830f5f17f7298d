"""Issue 20 (items 6, 8-15, 21) and issue 21 (items 9, 10): the report legible on real runs.

Real runs: a 219-tensor Llama, 12 steps in Hugging Face Trainer's ``checkpoint-N/``
folders, tables at 80 columns and through pipes."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import support
from support.cli import run
from support.formats_helpers import safetensors_bytes
from support.llama import llama_names, llama_tensors
from tclip.text import natural_key

def tclip_process(*args, env=None, **kwargs):
    full = {**os.environ, **(env or {})}
    return subprocess.run([sys.executable, "-m", "tclip", *map(str, args)], capture_output=True, text=True,
                          env=full, **kwargs)


def tty_run(args: list[str], columns: int, env: dict[str, str] | None = None, cwd: Path | None = None,
            check: bool = False) -> str:
    """tclip in a pseudo-terminal of ``columns`` columns, as a user sees it (``check``: exit 0 or fail)."""
    import pty

    code = ("import fcntl, struct, sys, termios; "
            f"fcntl.ioctl(1, termios.TIOCSWINSZ, struct.pack('HHHH', 50, {columns}, 0, 0)); "
            "from tclip.cli.entry import main; sys.argv = ['tclip'] + sys.argv[1:]; main()")
    full = {k: v for k, v in os.environ.items() if k not in ("NO_COLOR", "FORCE_COLOR")}
    full.update({"COLUMNS": str(columns), "TERM": "xterm-256color", **(env or {})})
    master, slave = pty.openpty()
    process = subprocess.Popen([sys.executable, "-c", code, *args], stdout=slave, stderr=subprocess.DEVNULL,
                               stdin=subprocess.DEVNULL, env=full, cwd=cwd)
    os.close(slave)
    chunks = []
    while True:
        try:
            chunk = os.read(master, 65536)
        except OSError:
            break
        if not chunk:
            break
        chunks.append(chunk)
    process.wait()
    os.close(master)
    text = b"".join(chunks).decode("utf-8", "replace").replace("\r\n", "\n")
    assert not check or process.returncode == 0, (process.returncode, text)
    return text


# ------------------------------------------------------------------ 21.9 natural sort


def test_natural_sort_takes_only_ascii_digits_as_numbers():
    names = ["w²", "w10", "w2", "w" + "9" * 5000, "w" + "1" * 4999 + "0", "w٣", "w007", "w7"]
    ordered = sorted(names, key=natural_key)
    assert ordered[:4] == ["w2", "w007", "w7", "w10"]
    assert ordered[4:6] == ["w" + "1" * 4999 + "0", "w" + "9" * 5000]  # by length, then digits: no int()
    assert set(ordered[6:]) == {"w²", "w٣"}  # text, not numbers


def test_odd_names_neither_stop_a_run_nor_crash_after_writing(tmp_path):
    odd = {"²": np.ones(3, np.float32), "layer." + "7" * 5000: np.full(3, 2.0, np.float32),
           "layer.3": np.full(3, 4.0, np.float32)}
    (tmp_path / "²").mkdir()
    source = tmp_path / "²" / "step_²².safetensors"
    source.write_bytes(safetensors_bytes(odd))
    (tmp_path / "²" / ("step_" + "5" * 200 + ".safetensors")).write_bytes(safetensors_bytes(odd))
    for command in (["report"], ["info"], ["norm", "--clip", "1"]):
        result = run(*command, tmp_path / "²")
        assert result.exit_code == 0, result.output
        assert "internal error" not in result.output
    assert "²" in run("report", source).stdout


# ------------------------------------------------------------------ 21.10 extreme values and names


def test_a_subnormal_clip_renders_its_table(tmp_path):
    source = tmp_path / "g.safetensors"
    source.write_bytes(safetensors_bytes(llama_tensors()))
    for command in (["norm", "--clip", "1e-320"], ["global", "--clip", "1e-320"], ["average", "--clip", "1e-320"]):
        result = run(*command, "--force", source)
        assert result.exit_code == 0, result.output
        assert "model.layers.17.self_attn.k_proj.weight" in result.stdout


@pytest.mark.slow  # measured 32 s
def test_names_over_255_bytes_are_one_clean_error(tmp_path):
    source = tmp_path / "g.safetensors"
    source.write_bytes(safetensors_bytes({"w": np.ones(3, np.float32)}))
    long = "a" * 300
    cases = [["report", tmp_path / f"{long}.npz"], ["norm", "--clip", "1", "--out-dir", tmp_path / long, source],
             ["norm", "--clip", "1", "--out-dir", tmp_path / long / "x", source],
             ["norm", "--clip", "1", "-o", tmp_path / f"{long}.npz", source],
             ["diff", tmp_path / long, source], ["info", tmp_path / long / "x.npz"]]
    for args in cases:
        result = tclip_process(*args)
        assert result.returncode == 1, (args, result.stderr)
        lines = result.stderr.splitlines()
        assert len(lines) == 1 and lines[0].startswith("Error: "), (args, result.stderr)
        assert "internal error" not in result.stderr and "Traceback" not in result.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["g.safetensors"]  # nothing written
    # One such name among good files: the others still run.
    result = tclip_process("report", tmp_path / f"{long}.npz", source)
    assert result.returncode == 1 and "g.safetensors" in result.stdout


def test_name_list_is_bounded():
    from tclip.text import name_list

    assert name_list(["a", "b"]) == "a, b"
    assert name_list([f"t{i}" for i in range(51)]) == "t0, t1, t2 and 48 more"
    assert name_list(["a", "b", "c"], total=40) == "a, b, c and 37 more"


# ------------------------------------------------------------------ 20.14 NO_COLOR


@pytest.mark.slow  # tclip in pseudo-terminals, 12 s
def test_no_color_writes_no_escape_codes_unless_color_always(tmp_path):
    source = tmp_path / "g.safetensors"
    source.write_bytes(safetensors_bytes(llama_tensors()))
    args = ["report", "--max-norm", "0.05", str(source)]
    assert "\x1b[" in tty_run(args, 80)  # a terminal gets colour by default
    plain = tty_run(args, 80, {"NO_COLOR": "1"})
    assert "\x1b[" not in plain and "model.layers.17.self_attn.k_proj.weight" in plain
    assert "\x1b[" in tty_run(args, 80, {"NO_COLOR": ""})  # set but empty: no-color.org says ignore it
    assert "\x1b[" in tty_run(["report", "--color", "always", *args[1:]], 80, {"NO_COLOR": "1"})


# ------------------------------------------------------------------ 20.12 unselected tensors are counted


@pytest.mark.parametrize("command", [["report"], ["norm", "--clip", "0.01", "--axes", "1", "--dry-run"],
                                     ["global", "--clip", "0.01", "--dry-run"]])
def test_unselected_tensors_are_counted_not_listed(tmp_path, command):
    source = tmp_path / "model.safetensors"
    source.write_bytes(safetensors_bytes(llama_tensors()))
    result = run(*command, "--include", "model.layers.17.*", source, env={"COLUMNS": "80"})
    assert result.exit_code == 0, result.output
    rows = [line for line in result.stdout.splitlines() if " float32 " in line]
    assert len(rows) == 9 and all(r.startswith("model.layers.17.") for r in rows)
    assert "210 not selected" in result.stdout and "not selected:" not in result.stdout
    assert re.search(r"  ·  (0|2) skipped", result.stdout)  # only the rank-1 norms, and only with --axes
    data = json.loads(run(*command, "--include", "model.layers.17.*", "--json", source).stdout)
    assert len(data["tensors"]) == 219 and data["tensors_not_selected"] == 210
    unselected = [t for t in data["tensors"] if not t["selected"]]
    assert len(unselected) == 210 and all(t["skipped"] is None for t in unselected)
    assert data["tensors_skipped"] == (2 if "--axes" in command else 0)


def test_unselected_tensors_of_an_index_are_counted_too(tmp_path):
    tensors = llama_tensors()
    names = list(tensors)
    weight_map = {}
    for k in range(3):
        shard = f"model-0000{k + 1}-of-00003.safetensors"
        (tmp_path / shard).write_bytes(safetensors_bytes({n: tensors[n] for n in names[k::3]}))
        weight_map.update({n: shard for n in names[k::3]})
    index = tmp_path / "model.safetensors.index.json"
    index.write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    data = json.loads(run("report", "--include", "model.layers.17.*", "--json", index).stdout)
    assert (len(data["tensors"]), data["tensors_not_selected"], data["tensors_skipped"]) == (219, 210, 0)
    text = run("report", "--include", "model.layers.17.*", index).stdout
    assert "210 not selected" in text and text.count("model.layers.17.") == 9


# ------------------------------------------------------------------ 20.11 bounded lines


def test_warning_and_error_lines_are_bounded_and_state_a_reason_once(tmp_path):
    tensors = llama_tensors()
    source = tmp_path / "model.safetensors"
    source.write_bytes(safetensors_bytes(tensors))
    result = run("norm", "--clip", "1", "--axes", "1", "--dry-run", source)
    warning = [line for line in result.stderr.splitlines() if line.startswith("Warning:")]
    assert len(warning) == 1 and len(warning[0]) < 300, warning
    assert warning[0].count("rank 1 has no axis 1") == 1
    assert "model.layers.0.input_layernorm.weight, model.layers.0.post_attention_layernorm.weight, " \
           "model.layers.1.input_layernorm.weight and 46 more (rank 1 has no axis 1)" in warning[0]  # natural order
    strict = run("norm", "--clip", "1", "--axes", "1", "--strict", source)
    assert strict.exit_code == 1 and len(strict.stderr) < 300 and strict.stderr.count("rank 1 has no axis 1") == 1
    table = run("report", "--axes", "1", source).stdout
    under = [line for line in table.splitlines() if line.startswith("no slices")]
    assert len(under) == 1 and under[0].endswith("and 46 more")
    for i in range(0, 24, 2):  # NaN in 12 tensors: three named, in natural order
        tensors[f"model.layers.{i}.mlp.up_proj.weight"][0, 0] = np.nan
    source.write_bytes(safetensors_bytes(tensors))
    refused = run("global", "--clip", "1", source)
    assert refused.exit_code == 1 and len(refused.stderr.splitlines()) == 1
    assert "model.layers.0.mlp.up_proj.weight (1 NaN), model.layers.2.mlp.up_proj.weight (1 NaN), " \
           "model.layers.4.mlp.up_proj.weight (1 NaN) and 9 more" in refused.stderr


def test_the_closing_line_of_a_run_names_a_few_failed_files(tmp_path):
    files = []
    for i in range(12):
        bad = tmp_path / f"step_{i}.safetensors"
        bad.write_bytes(b"not a tensor file at all")
        files.append(bad)
    result = run("report", *files)
    closing = result.stdout.strip().splitlines()[-1]
    assert closing.startswith("12 files: 0 ok, 12 failed") and closing.endswith("and 9 more)")


# ------------------------------------------------------------------ 20.10 how many slices of how many


def rows_with_norms(norms: list[float], width: int = 4096) -> np.ndarray:
    rows = np.zeros((len(norms), width), np.float32)
    rows[:, 0] = norms  # each row's norm is its one non-zero value
    return rows


def test_the_note_under_a_clip_table_counts_slices_then_names_the_worst(tmp_path):
    norms = [1.0] * 64
    for i in range(18, 64):
        norms[i] = 10.0 + i / 10  # 46 rows above 5
    norms[32], norms[63], norms[55] = 900.0, 800.0, 700.0
    source = tmp_path / "g.safetensors"
    name = "model.layers.17.self_attn.k_proj.weight"
    source.write_bytes(safetensors_bytes({name: rows_with_norms(norms),
                                          "model.layers.17.input_layernorm.weight": np.ones(8, np.float32)}))
    clipped = run("norm", "--clip", "5", "--axes", "1", "--dry-run", source, env={"COLUMNS": "80"}).stdout
    assert f"{name}: 46 of 64 rows clipped; worst: 32, 63, 55; smallest row norm 1" in clipped
    report = run("report", "--axes", "1", "--max-norm", "5", source)
    assert report.exit_code == 3
    assert f"{name}: 46 of 64 rows above 5; worst: 32, 63, 55; smallest row norm 1" in report.stdout
    data = json.loads(run("report", "--axes", "1", "--max-norm", "5", "--json", source).stdout)
    assert {t["name"]: t.get("slices_above") for t in data["tensors"]} == {
        name: 46, "model.layers.17.input_layernorm.weight": None}
    few = run("norm", "--clip", "750", "--axes", "1", "--dry-run", source).stdout
    assert f"{name}: 2 of 64 rows clipped: 32, 63;" in few
    norms[40] = float("nan")
    source.write_bytes(safetensors_bytes({name: rows_with_norms(norms)}))
    nan = run("report", "--axes", "1", "--max-norm", "850", source).stdout
    assert f"{name}: 2 of 64 rows above 850: 40, 32;" in nan  # a NaN row is over any limit, and named


# ------------------------------------------------------------------ 20.6 values flushed to zero


def test_nonzero_count_is_exact_for_every_code_of_every_narrow_float():
    import ml_dtypes

    from tclip.core.zeros import counted, nonzero_count

    names = ["bfloat16", "float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz", "float8_e4m3b11fnuz",
             "float8_e8m0fnu", "float4_e2m1fn"]
    dtypes = [np.dtype(np.float16), np.dtype(">f2")] + [np.dtype(getattr(ml_dtypes, n)) for n in names
                                                        if hasattr(ml_dtypes, n)]
    for dtype in dtypes:
        width = np.uint8 if dtype.itemsize == 1 else np.uint16
        codes = np.arange(1 << (8 * dtype.itemsize), dtype=np.int64).astype(width).view(dtype)
        with np.errstate(invalid="ignore"):
            expected = int(np.count_nonzero(codes.astype(np.float64) != 0))
        assert nonzero_count(codes) == expected, dtype
        assert nonzero_count(codes, np.empty(codes.size, np.uint32)) == expected, dtype
    assert not counted(np.dtype(np.float32)) and not counted(np.dtype(np.int16))


def flushing_tensors(dtype) -> dict[str, np.ndarray]:
    import ml_dtypes

    rng = np.random.default_rng(3)
    w = rng.standard_normal((256, 64)) * 1e-3
    # Small gradients, 1 to 8 times the dtype's smallest value: a factor below 1/16 flushes them.
    w[:, :16] = float(ml_dtypes.finfo(dtype).smallest_subnormal) * rng.integers(1, 9, (256, 16))
    return {"model.layers.0.mlp.down_proj.weight": w.astype(dtype),
            "model.layers.1.mlp.down_proj.weight": (w * 1000).astype(dtype),
            "model.layers.0.input_layernorm.weight": np.ones(64, dtype),
            "model.layers.0.self_attn.q_proj.weight": w.astype(np.float32)}


def read_safetensors(path: Path) -> dict[str, np.ndarray]:
    from support.formats_helpers import read_all

    return read_all(path)


@pytest.mark.parametrize("args", [["global", "--clip", "0.01"], ["norm", "--clip", "0.0005", "--axes", "1"]],
                         ids=["global", "norm-rows"])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float8_e4m3fn"])
def test_values_flushed_to_zero_are_counted_exactly_and_named(tmp_path, args, dtype):
    import ml_dtypes

    kind = np.dtype(getattr(ml_dtypes, dtype, None) or dtype)
    source = tmp_path / "g.safetensors"
    source.write_bytes(safetensors_bytes(flushing_tensors(kind)))
    result = run(*args, "--json", source)
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    before, after = read_safetensors(source), read_safetensors(tmp_path / "g.clipped.safetensors")
    with np.errstate(invalid="ignore"):
        lost = {n: int(np.count_nonzero(before[n].astype(np.float64)) - np.count_nonzero(after[n].astype(np.float64)))
                for n in before}
    counted = {t["name"]: t["flushed_to_zero"] for t in data["tensors"]}
    assert counted["model.layers.0.self_attn.q_proj.weight"] is None  # float32: not counted
    assert lost["model.layers.0.mlp.down_proj.weight"] > 0
    for name, count in counted.items():
        if count is not None:
            assert count == lost[name], name
    named = [n for n, c in sorted(counted.items(), key=lambda x: -(x[1] or 0)) if c]
    warning = [line for line in result.stderr.splitlines() if "flushed non-zero values to 0" in line]
    assert len(warning) == 1 and named[0] in warning[0]
    assert f"{named[0]} ({counted[named[0]]:,} of 16,384 values, {kind.name})" in warning[0]
    assert warning[0] in [f"Warning: {source}: {w}" for w in data["warnings"]]


def test_no_flush_no_warning_and_a_set_warns_once(tmp_path):
    import ml_dtypes

    tensors = flushing_tensors(ml_dtypes.bfloat16)
    source = tmp_path / "g.safetensors"
    source.write_bytes(safetensors_bytes(tensors))
    calm = run("global", "--clip", "1e6", "--json", "--dry-run", source)  # factor 1: nothing scaled
    assert "flushed" not in calm.stderr
    assert {t["flushed_to_zero"] for t in json.loads(calm.stdout)["tensors"]} <= {0, None}
    weight_map = {}
    for k, name in enumerate(tensors):
        shard = f"model-0000{k + 1}-of-00004.safetensors"
        (tmp_path / shard).write_bytes(safetensors_bytes({name: tensors[name]}))
        weight_map[name] = shard
    index = tmp_path / "model.safetensors.index.json"
    index.write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    result = run("global", "--clip", "0.01", "--dry-run", index)
    assert result.exit_code == 0, result.output
    assert len([line for line in result.stderr.splitlines() if "flushed" in line]) == 1


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz"])
@pytest.mark.parametrize("factor", [0.9, 0.5, 0.3, 2.0 ** -12, 1e-30, 0.0])
def test_the_range_of_codes_that_flush_counts_exactly(dtype, factor):
    import ml_dtypes

    from tclip.core.kernels import scale_unit
    from tclip.core.zeros import flush_limit, flushed_count, nonzero_count

    kind = np.dtype(getattr(ml_dtypes, dtype, None) or dtype)
    width = np.uint8 if kind.itemsize == 1 else np.uint16
    values = np.arange(1 << (8 * kind.itemsize), dtype=np.int64).astype(width).view(kind)
    limit = flush_limit(kind, factor)
    assert limit is not None
    scaled = values.copy()
    counted_before = flushed_count(values, limit, np.empty(values.size, np.uint32))
    scale_unit(scaled, factor)
    with np.errstate(invalid="ignore"):
        wide, after = values.astype(np.float64), scaled.astype(np.float64)
    assert counted_before == int(np.count_nonzero((wide != 0) & (after == 0)))
    assert counted_before == nonzero_count(values) - nonzero_count(scaled)
    assert (limit == 0) == (factor > 0.5)


# ------------------------------------------------------------------ 20.8, 20.9, 20.13 report --summary


SPIKED = "model.layers.17.self_attn.k_proj.weight"


def trainer_run(root: Path, folders: bool = True) -> list[Path]:
    """12 steps of a 219-tensor model, ±3% noise between steps, one tensor ×300 at step 700:
    Trainer's checkpoint-N/model.safetensors (or step_N.safetensors files)."""
    base = llama_tensors()
    rng = np.random.default_rng(7)
    paths = []
    for step in range(100, 1300, 100):
        tensors = {n: (v * (1 + 0.03 * rng.uniform(-1, 1))).astype(np.float32) for n, v in base.items()}
        if step == 700:
            tensors[SPIKED] = tensors[SPIKED] * 300
        if folders:
            path = root / f"checkpoint-{step}" / "model.safetensors"
            path.parent.mkdir(parents=True)
        else:
            path = root / f"step_{step}.safetensors"
        path.write_bytes(safetensors_bytes(tensors))
        paths.append(path)
    return paths


@pytest.mark.parametrize("columns", [80, 120])
def test_summary_labels_trainer_folders_and_keeps_what_tells_tensors_apart(tmp_path, columns):
    trainer_run(tmp_path / "trainer")
    screen = tty_run(["report", "--summary", str(tmp_path / "trainer" / "*" / "model.safetensors")], columns,
                     {"NO_COLOR": "1"})
    lines = screen.splitlines()
    assert all(len(line) <= columns for line in lines), [line for line in lines if len(line) > columns]
    rows = [line for line in lines if line.startswith("checkpoint-")]
    assert [r.split()[0] for r in rows[:12]] == [f"checkpoint-{s}" for s in range(100, 1300, 100)]
    spike = next(r for r in rows if r.startswith("checkpoint-700 "))
    assert re.search(r"layers\.17\.\S*k_proj\.weight", spike), spike  # layer and projection stay visible
    changes = [line for line in lines if "checkpoint-600 → checkpoint-700" in line]
    assert len(changes) == 1 and re.search(r"17\.\S*k_proj\.weight", changes[0])
    assert re.search(r"×(29\d|30\d)$", changes[0])


def test_summary_through_a_pipe_shows_whole_names_and_labels(tmp_path):
    trainer_run(tmp_path / "trainer")
    text = run("report", "--summary", tmp_path / "trainer" / "*" / "model.safetensors").stdout
    assert re.search(rf"^checkpoint-700 +[\d.]+ +█ +{re.escape(SPIKED)} ", text, re.M), text


def test_trend_sparkline_is_flat_for_noise_and_shows_a_spike():
    from tclip.cli.render.table import UNICODE, trend_sparkline

    rng = np.random.default_rng(0)
    noise = [2.0 * (1 + 0.03 * rng.uniform(-1, 1)) for _ in range(10)]
    assert trend_sparkline(noise, UNICODE) == "▂" * 10  # ±3%: flat
    assert trend_sparkline([2.0] * 5 + [2.02] + [2.0] * 4, UNICODE) == "▂" * 10  # a 1% rise is no block
    spiked = noise[:6] + [noise[6] * 300] + noise[7:]
    assert trend_sparkline(spiked, UNICODE) == "▂" * 6 + "█" + "▂" * 3
    doubled = trend_sparkline([2.0] * 9 + [4.0], UNICODE)
    assert doubled[:9] == "▂" * 9 and doubled[9] in "▃▄▅"  # 2x: a bump, not a full block
    assert trend_sparkline([2.0, float("nan"), 2.0, 0.5, float("inf")], UNICODE) == "▂!▂▁!"


def test_summary_header_sparkline_on_real_steps(tmp_path):
    trainer_run(tmp_path, folders=False)
    first = run("report", "--summary", tmp_path / "step_*.safetensors").stdout.splitlines()[0]
    assert first == "12 files, global norm ▂▂▂▂▂▂█▂▂▂▂▂"


def test_summary_honours_top_and_sort_and_rejects_stats(tmp_path):
    trainer_run(tmp_path, folders=False)
    pattern = str(tmp_path / "step_*.safetensors")
    refused = run("report", "--summary", "--stats", pattern)
    assert refused.exit_code == 2 and "--stats" in refused.stderr and "--summary" in refused.stderr
    text = run("report", "--summary", "--top", "3", pattern).stdout
    after = text.split("largest changes between consecutive files")[1].strip().splitlines()
    assert len([line for line in after if " → " in line]) == 3
    lines = run("report", "--summary", "--top", "2", "--json", pattern).stdout.splitlines()
    objects = [json.loads(line) for line in lines]
    assert max(len(o["changes"]) for o in objects) == 2
    by_norm = run("report", "--summary", "--sort", "norm", pattern).stdout.splitlines()
    assert by_norm[3].startswith("step_700 ")  # the largest global norm first
    given = [tmp_path / f"step_{s}.safetensors" for s in (1200, 100, 700)]
    ordered = run("report", "--summary", "--sort", "order", *given).stdout.splitlines()
    assert [line.split()[0] for line in ordered[3:6]] == ["step_1200", "step_100", "step_700"]
    assert "step_1200 → step_100" in run("report", "--summary", "--sort", "order", *given).stdout


def test_columns_that_give_way_are_named(tmp_path):
    source = tmp_path / "model.safetensors"
    source.write_bytes(safetensors_bytes(llama_tensors()))
    screen = tty_run(["report", "--stats", str(source)], 80, {"NO_COLOR": "1"})
    note = [line for line in screen.splitlines() if line.startswith("left out at 80 columns:")]
    header = next(line for line in screen.splitlines() if line.startswith("tensor"))
    assert len(note) == 1 and len(note[0]) <= 80
    for column in ("min", "max", "mean", "log2 |x|"):
        assert (f" {column}" in header) != (column in note[0]), column  # shown, or said to be left out
    assert "left out" not in run("report", "--stats", source).stdout  # a pipe shows every column


def test_names_never_cut_below_layer_and_projection(tmp_path):
    import io

    from rich.console import Console

    from tclip.cli.render.report import render_file
    from tclip.work.clip import report_file

    source = tmp_path / "model.safetensors"
    source.write_bytes(safetensors_bytes(llama_tensors()))
    report = report_file(source, moments=True)
    for width in (50, 60, 80):
        console = Console(file=io.StringIO(), width=width, color_system=None)
        render_file(report, console, stats=True)
        rows = [line for line in console.file.getvalue().splitlines() if ".weight " in line]
        for name in (n for n in llama_names() if ".layers." in n):
            layer = name.split(".")[2]
            part = name.split(".")[-2]
            kept = rf"(^|\.|…){layer}\.\S*{re.escape(part)}\.weight"
            assert any(re.search(kept, row) for row in rows), (width, name)


# ------------------------------------------------------------------ 20.15 batch clipping


def test_clipping_twelve_step_files_prints_a_handful_of_lines(tmp_path):
    trainer_run(tmp_path, folders=False)
    result = run("norm", "--clip", "0.05", "--axes", "1", "--summary", tmp_path / "step_*.safetensors",
                 env={"COLUMNS": "80"})
    assert result.exit_code == 0, result.output
    out, err = result.stdout.splitlines(), result.stderr.splitlines()
    assert len(out) + len(err) <= 20, result.output
    assert out[0] == "12 files, written each beside its input as NAME.clipped.EXT"
    rows = [line for line in out if line.startswith("step_")]
    assert [r.split()[0] for r in rows] == [f"step_{s}" for s in range(100, 1300, 100)]
    assert len(err) == 1 and err[0].startswith("Warning: 12 files (") and "49 tensors left unchanged" in err[0]
    assert out[-1] == "12 files: 12 ok"
    assert len(list(tmp_path.glob("step_*.clipped.safetensors"))) == 12
    # --json stays complete: one object per file with every tensor.
    objects = [json.loads(line) for line in run("norm", "--clip", "0.05", "--axes", "1", "--summary", "--json",
                                                 "--force", tmp_path / "step_*.safetensors").stdout.splitlines()]
    assert len(objects) == 12 and all(len(o["tensors"]) == 219 for o in objects)


def test_clip_top_and_bounded_slice_notes(tmp_path):
    source = trainer_run(tmp_path, folders=False)[6]
    result = run("norm", "--clip", "0.03", "--axes", "1", "--top", "3", "--dry-run", source)
    assert result.exit_code == 0, result.output
    rows = [line for line in result.stdout.splitlines() if " float32 " in line]
    assert len(rows) == 3 and any(r.startswith(SPIKED) for r in rows)
    assert "216 more tensor(s) not shown (--top 3)" in result.stdout
    notes = [line for line in result.stdout.splitlines() if re.search(r": \d+ of \d+ rows clipped", line)]
    assert len(notes) == 3  # the tensors shown
    everything = run("norm", "--clip", "0.03", "--axes", "1", "--dry-run", source).stdout.splitlines()
    notes = [line for line in everything if re.search(r": \d+ of \d+ rows clipped", line)]
    assert len(notes) == 5 and notes[0].startswith(f"{SPIKED}: 8 of 8 rows clipped")
    assert any(re.match(r"and \d+ more tensors with clipped or near-zero slices", line) for line in everything)


def test_summary_says_a_warning_shared_by_every_file_once(tmp_path):
    trainer_run(tmp_path, folders=False)
    result = run("report", "--summary", "--include", "model.*", "--include", "vision.*",
                 tmp_path / "step_*.safetensors")
    assert result.exit_code == 0, result.output
    warnings = result.stderr.splitlines()
    assert len(warnings) == 1 and warnings[0].startswith(f"Warning: 12 files ({tmp_path}/step_100.safetensors and 11 ")
    assert warnings[0].endswith("pattern 'vision.*' matches no tensor")


# ------------------------------------------------------------------ 20.21 README's first example


def test_readme_first_example_runs_twice_and_prints_what_readme_shows(tmp_path, monkeypatch):
    import shlex
    import shutil

    root = support.ROOT
    readme = (root / "README.md").read_text()
    command = next(line for line in readme.splitlines() if line.startswith("    pip install . && tclip "))
    args = shlex.split(command.split("&& tclip ", 1)[1])
    sample = readme.split("In an\n80-column terminal:\n\n", 1)[1].split("\n\n", 1)[0].splitlines()
    (tmp_path / "samples").mkdir()
    shutil.copy(root / "samples" / "grads.npz", tmp_path / "samples" / "grads.npz")
    for _ in range(2):  # a newcomer runs it again: it must work again
        screen = tty_run(args, 80, {"NO_COLOR": "1"}, cwd=tmp_path, check=True)
        assert (tmp_path / "samples" / "grads.clipped.npz").exists()
    printed = screen.splitlines()
    assert printed[0] == sample[0].strip() == "samples/grads.npz → samples/grads.clipped.npz"
    timing = len(sample) - 1  # the last line holds times and speeds
    assert [line.rstrip() for line in printed[1:timing]] == [line[4:].rstrip() for line in sample[1:timing]]
