"""Issue 8: a report that never hides the answer (names, gate, selections, views, conventions)."""

from __future__ import annotations

import io
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import h5py
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from rich.console import Console

import support
from support.cli import run
from support.formats_helpers import safetensors_bytes
from tclip.cli.render.report import render_file
from tclip.cli.render.table import shorten_names
from tclip.core.modes import NormClip
from tclip.work.clip import clip_file, report_file
from tclip.work.options import ClipOptions
from tclip.text import fmt_column, natural_key

LLAMA = [f"model.layers.{i}.self_attn.{p}_proj.weight" for i in (2, 10, 17) for p in "qkv"]
T5 = ["encoder.block.1.layer.0.SelfAttention.q.weight", "encoder.block.11.layer.0.SelfAttention.q.weight",
      "encoder.block.1.layer.1.DenseReluDense.wi.weight", "encoder.block.11.layer.1.DenseReluDense.wi.weight"]
SHORT = ["enc.layer0.weight", "enc.layer1.weight"]


def tclip_process(*args, **kwargs):
    return subprocess.run([sys.executable, "-m", "tclip", *map(str, args)], capture_output=True, text=True, **kwargs)


def write_st(path: Path, names: list[str], scale: float = 1.0) -> Path:
    rng = np.random.default_rng(0)
    path.write_bytes(safetensors_bytes({n: (rng.standard_normal((4, 3)) * scale).astype(np.float32) for n in names}))
    return path


def rendered(report, width, **kwargs) -> str:
    console = Console(file=io.StringIO(), width=width, color_system=None)
    render_file(report, console, **kwargs)
    return console.file.getvalue()


def shown_names(text: str, count: int) -> list[str]:
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("tensor")) + 2
    return [line.split("  ")[0].rstrip() for line in lines[start:start + count]]


# ------------------------------------------------------------------ 1. names


@pytest.mark.parametrize("width", [60, 80, 120])
@pytest.mark.parametrize("names", [LLAMA, T5, SHORT], ids=["llama", "t5", "short"])
def test_names_never_render_alike_and_fit(tmp_path, width, names):
    report = report_file(write_st(tmp_path / "g.safetensors", names))
    text = rendered(report, width)
    shown = shown_names(text, len(names))
    assert len(set(shown)) == len(names), shown
    assert all(len(line) <= width for line in text.splitlines()[1:]), text
    assert "NaN/Inf" in text  # never dropped
    for name, short in zip(sorted(names), shown):
        if len(name) + 30 < width:
            assert short == name  # whole whenever the width allows


def test_llama_names_whole_at_80_columns(tmp_path):
    report = report_file(write_st(tmp_path / "g.safetensors", LLAMA))
    assert shown_names(rendered(report, 80, sort="name"), len(LLAMA)) == sorted(LLAMA, key=natural_key)


def test_t5_names_whole_at_200_columns_and_distinct_at_60(tmp_path):
    report = report_file(write_st(tmp_path / "g.safetensors", T5))
    assert set(shown_names(rendered(report, 200), 4)) == set(T5)
    narrow = shown_names(rendered(report, 60), 4)
    assert len(set(narrow)) == 4 and any("block.11" in n or ".11." in n for n in narrow)


def test_columns_give_way_before_the_name(tmp_path):
    report = clip_file(write_st(tmp_path / "g.safetensors", LLAMA, 10.0), NormClip(1.0), ClipOptions(dry_run=True))
    text = rendered(report, 90)
    assert "█" not in text  # the bar went first
    assert set(shown_names(text, len(LLAMA))) == set(LLAMA)


def test_a_pipe_never_cuts_names(tmp_path):
    long = ["x" * 150 + ".layers.3.weight", "x" * 150 + ".layers.4.weight"]
    result = run("report", write_st(tmp_path / "g.safetensors", long))
    assert result.exit_code == 0, result.output
    assert all(name in result.output for name in long)


@settings(max_examples=150)
@given(st.lists(st.tuples(st.sampled_from(["model", "encoder.block", "h", "transformer.h"]), st.integers(0, 120),
                          st.sampled_from(["attn.q_proj.weight", "attn.k_proj.weight", "mlp.fc1.bias", "ln.weight"])),
                min_size=2, max_size=30, unique=True),
       st.integers(8, 60))
def test_shortened_names_are_unique_and_keep_the_index(parts, width):
    names = sorted({f"{a}.{i}.{b}" for a, i, b in parts})
    shown = shorten_names(names, width)
    assert len(set(shown.values())) == len(names)
    for name, text in shown.items():
        assert len(text) <= width or text == name


# ------------------------------------------------------------------ 2-3. the gate


def test_gate_sees_nan_inf_in_a_tensor_skipped_for_its_rank(tmp_path):
    source = tmp_path / "g.safetensors"
    source.write_bytes(safetensors_bytes({"w": np.ones((3, 4), np.float32),
                                          "b": np.array([1, np.inf, np.nan, 2], np.float32)}))
    result = run("report", "--axes", "1", "--max-norm", "100", "--json", source)
    assert result.exit_code == 3, result.output
    tensors = {t["name"]: t for t in json.loads(result.stdout)["tensors"]}
    assert tensors["b"]["nonfinite"] == {"nan": 1, "inf": 1}
    assert tensors["b"]["skipped"] == "rank 1 has no axis 1" and tensors["b"]["norm"] == "nan"
    assert "check failed: NaN/Inf in b (1 NaN, 1 Inf)" in result.stderr


def test_gate_sees_nan_in_a_complex_tensor_which_is_measured_not_counted(tmp_path):
    source = tmp_path / "g.npz"
    z = np.array([[3 + 4j, 0], [1, 1j]], np.complex64)
    np.savez(source, z=z, w=np.ones(4, np.float32))
    data = json.loads(run("report", "--json", source).stdout)
    tensors = {t["name"]: t for t in data["tensors"]}
    assert tensors["z"]["norm"] == pytest.approx(np.linalg.norm(z.astype(np.complex128)), rel=1e-15)
    assert tensors["z"]["skipped"] == "complex64 is not floating-point"
    assert data["global_norm"] == 2.0  # over the floating tensors only
    z[1, 1] = np.nan
    np.savez(source, z=z, w=np.ones(4, np.float32))
    result = run("report", "--max-norm", "100", "-q", source)
    assert result.exit_code == 3
    assert "NaN/Inf in z (1 NaN)" in result.stderr


def test_a_nan_norm_is_named_as_the_largest(tmp_path):
    source = tmp_path / "g.safetensors"
    source.write_bytes(safetensors_bytes({"a": np.ones(3, np.float32), "b": np.array([1.0, np.nan], np.float32)}))
    result = run("report", "--max-norm", "100", "-q", source)
    assert result.exit_code == 3 and "(largest: b, nan)" in result.stderr


def test_gate_passes_on_tclips_own_output_and_names_the_slice(tmp_path):
    rng = np.random.default_rng(5)
    source = tmp_path / "g.safetensors"
    source.write_bytes(safetensors_bytes({"fc2.weight": (rng.standard_normal((64, 128)) * 3).astype(np.float32)}))
    assert run("norm", "--clip", "5", "--axes", "1", "-q", source).exit_code == 0
    clipped = tmp_path / "g.clipped.safetensors"
    result = run("report", "--axes", "1", "--max-norm", "5", "-q", clipped)
    assert result.exit_code == 0, result.stderr
    over = run("report", "--axes", "1", "--max-norm", "5", "-q", source)
    assert over.exit_code == 3
    line = over.stderr.strip()
    assert line.startswith(f"Warning: {source}: check failed: row norm ") and " above 5 in fc2.weight row " in line


def test_gate_on_the_global_norm_names_the_value(tmp_path):
    source = write_st(tmp_path / "g.safetensors", ["a", "b"], 10.0)
    result = run("report", "--max-norm", "1", "-q", source)
    assert result.exit_code == 3 and result.stdout == ""
    assert "check failed: global norm " in result.stderr and "above 1 (largest: " in result.stderr


# ------------------------------------------------------------------ 4-5. selections and what is not a tensor


@pytest.fixture
def h5(tmp_path) -> Path:
    path = tmp_path / "m.h5"
    with h5py.File(path, "w") as f:
        f.create_dataset("encoder/dense/kernel", data=np.full((4, 4), 2.0, np.float32))
        f.create_dataset("vocab", data=np.array([b"<pad>", b"the"]))
    return path


def test_leading_slash_patterns_and_patterns_matching_nothing(h5):
    assert run("report", "--include", "/encoder/*", "--max-norm", "100", h5).exit_code == 0
    warned = run("report", "--include", "/decoder/*", h5)
    assert warned.exit_code == 0 and "Warning: " in warned.stderr and "'/decoder/*' matches no tensor" in warned.stderr
    failed = run("report", "--include", "/decoder/*", "--max-norm", "1", h5)
    assert failed.exit_code == 1 and "Error: " in failed.stderr and "matches no tensor" in failed.stderr


def test_axes_that_fit_no_tensor_is_an_error(tmp_path):
    source = write_st(tmp_path / "g.safetensors", ["a"])
    result = run("norm", "--clip", "1", "--axes", "5", source)
    assert result.exit_code == 1 and "--axes 5 fits no tensor of the file" in result.stderr
    assert not (tmp_path / "g.clipped.safetensors").exists()


def test_non_numeric_datasets_are_listed_and_never_dropped_silently(h5, tmp_path):
    info = run("info", h5)
    assert "vocab" in info.stdout and "string dataset" in info.stdout
    report = run("report", h5)
    assert "skipped (not a tensor: string dataset): vocab" in report.stdout
    data = json.loads(run("report", "--json", h5).stdout)
    assert data["not_tensors"][0]["name"] == "vocab"
    converted = run("norm", "--clip", "1", "-o", tmp_path / "m.safetensors", h5)
    assert converted.exit_code == 1 and "vocab (string dataset)" in converted.stderr
    assert not (tmp_path / "m.safetensors").exists()
    dropped = run("norm", "--clip", "1", "-o", tmp_path / "m.safetensors", "--drop-nonnumeric", h5)
    assert dropped.exit_code == 0 and "Warning: " in dropped.stderr and "vocab" in dropped.stderr


# ------------------------------------------------------------------ 6. progress


def test_progress_counts_reach_the_whole_run(tmp_path):
    source = write_st(tmp_path / "g.safetensors", LLAMA, 10.0)
    seen = []
    clip_file(source, NormClip(1.0), progress=seen.append)
    assert sum(seen) == 2 * source.stat().st_size  # two passes
    seen.clear()
    report_file(source, progress=seen.append)
    assert sum(seen) == source.stat().st_size


# ------------------------------------------------------------------ 7. conventions


def test_quiet_keeps_the_failed_check(tmp_path):
    source = write_st(tmp_path / "g.safetensors", ["a"], 100.0)
    result = run("report", "-q", "--max-norm", "1", source)
    assert result.exit_code == 3 and result.stdout == "" and "check failed" in result.stderr


def test_version_short_flag_color_and_strict_placement():
    assert run("-V").output.startswith("tclip, version ")
    assert "--strict" in run("norm", "--help").output
    for command in ("value", "average", "global", "report"):
        assert "--strict" not in run(command, "--help").output


def test_color_always_and_never(tmp_path):
    source = write_st(tmp_path / "g.safetensors", ["a"], 100.0)
    assert "\x1b[" in run("report", "--color", "always", "--max-norm", "1", source).stdout
    assert "\x1b[" not in run("report", "--color", "never", source).stdout


def test_out_dir_is_created_and_dry_run_names_the_output(tmp_path):
    source = write_st(tmp_path / "g.safetensors", ["a"], 100.0)
    dry = run("norm", "--clip", "1", "--dry-run", "--out-dir", tmp_path / "new" / "dir", source)
    assert dry.exit_code == 0 and "would write" in dry.stdout and str(tmp_path / "new" / "dir") in dry.stdout
    assert not (tmp_path / "new").exists()
    (tmp_path / "bad.safetensors").write_bytes(b"not a tensor file")
    failed = run("norm", "--clip", "1", "--out-dir", tmp_path / "new" / "dir", tmp_path / "bad.safetensors")
    assert failed.exit_code == 1 and not (tmp_path / "new").exists()  # a run that writes nothing leaves no folder
    made = run("norm", "--clip", "1", "--out-dir", tmp_path / "new" / "dir", source)
    assert made.exit_code == 0 and (tmp_path / "new" / "dir" / "g.safetensors").exists()
    again = json.loads(run("norm", "--clip", "1", "--dry-run", "--json", "--out-dir", tmp_path / "new" / "dir",
                           source).stdout)
    assert again["would_write"] == {"output": str(tmp_path / "new" / "dir" / "g.safetensors"), "exists": True,
                                   "in_place": False}


def test_unwritable_folder_is_named(tmp_path, monkeypatch):
    source = write_st(tmp_path / "g.safetensors", ["a"], 100.0)
    real_open = os.open

    def deny(path, flags, *args):
        if str(path).endswith(".tclip-tmp"):
            raise PermissionError(13, "Permission denied", str(path))
        return real_open(path, flags, *args)

    monkeypatch.setattr(os, "open", deny)
    result = run("norm", "--clip", "1", source)
    assert result.exit_code == 1
    assert result.stderr.strip() == f"Error: {tmp_path}: cannot write to this folder (Permission denied)"


def test_one_number_format_per_column():
    assert fmt_column([1e-5, 3.0, None]) == ["1.000e-05", "3.000e+00", "—"]
    assert fmt_column([0.5, 3.0, 0.0]) == ["0.5", "3", "0"]


def test_non_utf8_output_never_raises(tmp_path):
    source = write_st(tmp_path / "g.safetensors", ["couche.poids.é", "层.权重"], 10.0)
    result = tclip_process("norm", "--clip", "1", "--color", "never", source,
                           env={**os.environ, "PYTHONIOENCODING": "ascii"})
    assert result.returncode == 0, result.stderr
    assert "->" in result.stdout and "\\u5c42" in result.stdout


def test_broken_pipe_exits_quietly(tmp_path):
    files = [write_st(tmp_path / f"g{i}.safetensors", LLAMA) for i in range(40)]
    process = subprocess.run(f"{sys.executable} -m tclip report {' '.join(map(str, files))} | head -n 1",
                             shell=True, capture_output=True, text=True, executable="/bin/bash")
    assert process.stderr == ""
    piped = subprocess.run(["bash", "-c", f"set -o pipefail; {sys.executable} -m tclip report "
                            f"{' '.join(map(str, files))} | head -n 1; echo status=$?"],
                           capture_output=True, text=True)
    assert "status=141" in piped.stdout
    assert "Traceback" not in piped.stderr


def test_ctrl_c_exits_130_without_a_traceback():
    process = subprocess.Popen([sys.executable, "-c", "import time, sys; sys.argv=['tclip', '--help']\n"
                                "time.sleep(0.3)\nfrom tclip.cli.entry import main\nmain()"],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    process.send_signal(signal.SIGINT)
    out, err = process.communicate(timeout=30)
    assert "Traceback" in err or process.returncode != 0  # interrupted before tclip's entry point: python's own
    started = subprocess.Popen([sys.executable, "-m", "tclip", "report", "/dev/stdin"], stdin=subprocess.PIPE,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    time.sleep(1.0)
    started.send_signal(signal.SIGINT)
    out, err = started.communicate(timeout=30)
    assert started.returncode in (1, 130) and "Traceback" not in err


def test_shell_completion_completes_file_names():
    result = subprocess.run([sys.executable, "-m", "tclip"], capture_output=True, text=True,
                            env={**os.environ, "_TCLIP_COMPLETE": "bash_complete", "COMP_WORDS": "tclip report sam",
                                 "COMP_CWORD": "2"})
    assert result.returncode == 0 and "file" in result.stdout


def test_sample_files_are_rebuilt_identically(tmp_path):
    samples = support.ROOT / "samples"
    before = {p.name: p.read_bytes() for p in samples.glob("grads.*")}
    subprocess.run([sys.executable, str(samples / "make_samples.py")], check=True, capture_output=True)
    after = {p.name: p.read_bytes() for p in samples.glob("grads.*")}
    assert after == before


# ------------------------------------------------------------------ the added views


def test_sort_natural_and_top(tmp_path):
    names = [f"layers.{i}.w" for i in (10, 2, 1)]
    source = write_st(tmp_path / "g.safetensors", names)
    text = run("report", source).stdout
    assert text.index("layers.1.w") < text.index("layers.2.w") < text.index("layers.10.w")
    top = run("report", "--top", "1", "--sort", "norm", source).stdout
    assert "2 more tensor(s) not shown (--top 1)" in top


def test_clip_tables_and_info_list_names_in_natural_order_too(tmp_path):
    names = [f"layers.{i}.w" for i in (10, 2, 1)]
    source = write_st(tmp_path / "g.safetensors", names)  # the header keeps them as layers.1, layers.10, layers.2
    for args in (["norm", "--clip", "1", "--dry-run"], ["global", "--clip", "1", "--dry-run"], ["info"]):
        text = run(*args, source).stdout
        assert text.index("layers.1.w") < text.index("layers.2.w") < text.index("layers.10.w"), args
    text = run("info", "--sort", "order", source).stdout
    assert text.index("layers.1.w") < text.index("layers.10.w") < text.index("layers.2.w")


def test_skipped_tensors_are_named_in_natural_order(tmp_path):
    source = tmp_path / "g.safetensors"
    source.write_bytes(safetensors_bytes({f"layers.{i}.bias": np.ones(3, np.float32) for i in (10, 2, 1)}
                                         | {"layers.1.weight": np.ones((3, 3), np.float32)}))
    text = run("report", "--axes", "1", source).stdout
    assert "measured whole: layers.1.bias, layers.2.bias, layers.10.bias" in text


@pytest.mark.parametrize("width", [40, 60, 80, 120])
def test_the_rule_under_the_header_spans_the_table(tmp_path, width):
    from tclip.cli.render.info import render_info
    from tclip.work.clip import file_info

    source = write_st(tmp_path / "g.safetensors", LLAMA, 10.0)
    console = Console(file=io.StringIO(), width=width, color_system=None)
    render_info(file_info(source), console, width=width)
    texts = [rendered(report_file(source), width),
             rendered(clip_file(source, NormClip(1.0), ClipOptions(dry_run=True)), width),
             console.file.getvalue()]
    for text in texts:
        lines = [line.rstrip() for line in text.splitlines()]
        rule = next(i for i, line in enumerate(lines) if line and set(line) == {"─"})
        rows = lines[rule + 1:rule + 1 + len(LLAMA)]
        assert len(lines[rule]) == max(len(row) for row in rows + [lines[rule - 1]]), text


def test_slices_by_index_smallest_and_dead(tmp_path):
    w = np.ones((64, 8), np.float32)
    w[[7, 42]] *= 100
    w[[3, 5, 9]] = 0
    source = tmp_path / "g.safetensors"
    source.write_bytes(safetensors_bytes({"fc2.weight": w}))
    result = run("report", "--axes", "1", "--max-norm", "10", source)
    assert result.exit_code == 3
    assert "fc2.weight: 2 of 64 rows above 10: 7, 42; smallest row norm 0; 3 of 64 rows near zero" in result.stdout
    data = json.loads(run("report", "--axes", "1", "--json", source).stdout)["tensors"][0]
    assert data["near_zero_slices"] == 3 and data["min_slice_norm"] == 0
    assert [s["index"] for s in data["worst_slices"][:2]] in ([[7], [42]], [[42], [7]])


def test_stats_in_json_and_table(tmp_path):
    t = np.array([[0.0, 1.0, -3.0, 0.5]], np.float32)
    source = tmp_path / "g.safetensors"
    source.write_bytes(safetensors_bytes({"w": t}))
    data = json.loads(run("report", "--json", source).stdout)["tensors"][0]
    assert (data["min"], data["max"], data["zeros"], data["zero_fraction"]) == (-3.0, 1.0, 1, 0.25)
    assert data["mean"] == pytest.approx(-0.375) and data["std"] == pytest.approx(float(np.std(t.astype(float))))
    assert data["log2_histogram"] == {"lowest": -1, "counts": [1, 1, 1]}  # 0.5, 1 and 3
    table = run("report", "--stats", source).stdout
    assert "mean" in table and "zeros" in table and "25.0%" in table


def test_summary_across_files(tmp_path):
    for step, scale in ((1, 1.0), (2, 1.0), (10, 80.0), (11, 1.0)):
        write_st(tmp_path / f"step_{step}.safetensors", ["model.layers.0.w", "model.layers.1.w"], scale)
    result = run("report", "--summary", str(tmp_path / "step_*.safetensors"))
    assert result.exit_code == 0, result.stderr
    text = result.stdout
    assert text.index("step_2 ") < text.index("step_10 ") < text.index("step_11 ")  # stems, natural order
    assert "largest changes between consecutive files" in text and "×80" in text
    objects = [json.loads(line) for line in run("report", "--summary", "--json",
                                                  str(tmp_path / "step_*.safetensors")).stdout.splitlines()]
    assert [Path(o["file"]).name for o in objects] == [f"step_{s}.safetensors" for s in (1, 2, 10, 11)]
    assert objects[2]["changes"][0]["ratio"] == pytest.approx(80.0)
