"""``report --summary``: what its "largest changes" say is never misleading.

NaN that stays from one file to the next is no change (nor "gone"); the NaN/Inf that
appear at one step are one event, which never pushes a real spike out of the list; a
change of 1.003 shows its digits; a shortened name never reads as another layer's."""

from __future__ import annotations

import io
import json
import re
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from rich.console import Console

from support.cli import run
from support.formats_helpers import safetensors_bytes
from support.llama import llama_tensors
from tclip.cli.render.summary import render_across_files
from tclip.cli.render.table import abbreviate, essential, shorten_names
from tclip.work.clip import report_file

SPIKE = "model.layers.9.mlp.up_proj.weight"


def write_steps(root: Path, edits: dict[int, dict[str, object]], steps=(100, 200, 300, 400, 500)) -> list[Path]:
    """Trainer's checkpoint-N/model.safetensors of a 219-tensor Llama, the same values at every
    step but for ``edits``: per step, a tensor's factor, or "nan" for a NaN in its first element."""
    base = llama_tensors()
    paths = []
    for step in steps:
        tensors = {n: v.copy() for n, v in base.items()}
        for name, edit in edits.get(step, {}).items():
            if edit == "nan":
                tensors[name].flat[0] = np.nan
            else:
                tensors[name] = (tensors[name] * edit).astype(np.float32)
        path = root / f"checkpoint-{step}" / "model.safetensors"
        path.parent.mkdir(parents=True)
        path.write_bytes(safetensors_bytes(tensors))
        paths.append(path)
    return paths


def rendered(paths: list[Path], width: int | None, top: int = 10) -> str:
    console = Console(file=io.StringIO(), width=width or 400, color_system=None)
    render_across_files([report_file(p) for p in paths], console, width, top=top)
    return console.file.getvalue()


def changes_section(text: str) -> list[str]:
    return text.split("largest changes between consecutive files")[1].strip().splitlines()


NAN_NAMES = list(llama_tensors())[10:60]  # 50 tensors of layers 1 to 6 (not the spiked one)


@pytest.mark.parametrize("width", [80, 120])
def test_nan_that_stays_is_not_gone_and_leaving_is(tmp_path, width):
    nan = {n: "nan" for n in NAN_NAMES[:2]}
    paths = write_steps(tmp_path, {300: nan, 400: nan})
    text = rendered(paths, width)
    assert all(len(line) <= width for line in text.splitlines()), text
    section = changes_section(text)
    appeared = [line for line in section if line.startswith("NaN/Inf appeared")]
    gone = [line for line in section if line.startswith("NaN/Inf gone")]
    assert len(appeared) == 1 and "in 2 tensors at checkpoint-300" in appeared[0], section
    assert len(gone) == 1 and "from 2 tensors at checkpoint-500" in gone[0], section
    assert not any("checkpoint-300 → checkpoint-400" in line for line in section), section  # no change there
    assert "NaN/Inf gone" not in "".join(line for line in section if "→" in line)


def test_nan_that_stays_in_json(tmp_path):
    nan = {NAN_NAMES[0]: "nan"}
    paths = write_steps(tmp_path, {300: nan, 400: nan})
    objects = [json.loads(line) for line in run("report", "--summary", "--json", *paths).stdout.splitlines()]
    assert [o["nonfinite_appeared"] for o in objects] == [[], [], [NAN_NAMES[0]], [], []]
    assert [o["nonfinite_gone"] for o in objects] == [[], [], [], [], [NAN_NAMES[0]]]
    assert all(c["name"] != NAN_NAMES[0] for o in objects for c in o["changes"])


@pytest.mark.parametrize("top", [10, 40])
@pytest.mark.parametrize("width", [80, 120])
def test_fifty_nan_appearances_are_one_event_and_keep_the_spike(tmp_path, top, width):
    edits = {400: {**{n: "nan" for n in NAN_NAMES}, SPIKE: 9617.0}}
    paths = write_steps(tmp_path, edits, steps=(100, 200, 300, 400))
    section = changes_section(rendered(paths, width, top))
    assert len([line for line in section if line.startswith("NaN/Inf appeared")]) == 1
    head = "NaN/Inf appeared in 50 tensors at checkpoint-400"
    at = next(i for i, line in enumerate(section) if line.startswith(head))
    named = section[at] if width == 120 else section[at + 1]  # at 80 the names go on a line of their own, whole
    assert re.search(r"(: |^  )model\.layers\.1\.input_layernorm\.weight(, | and )", named), section
    spike = [line for line in section if "mlp.up_proj.weight" in line and "→" in line]
    assert spike and re.search(r"×9,61[67]$", spike[0]), section
    objects = [json.loads(line) for line in run("report", "--summary", "--json", "--top", top, *paths).stdout
               .splitlines()]
    assert objects[3]["changes"][0]["name"] == SPIKE and objects[3]["changes"][0]["kind"] == "ratio"
    assert sorted(objects[3]["nonfinite_appeared"]) == sorted(NAN_NAMES)


@pytest.mark.parametrize("width", [80, 120])
def test_a_small_change_shows_the_digits_that_make_it_one(tmp_path, width):
    paths = write_steps(tmp_path, {200: {SPIKE: 1.003}}, steps=(100, 200, 300))
    section = changes_section(rendered(paths, width))
    rows = [line for line in section if "→" in line]
    assert len(rows) == 2 and "up_proj" in rows[0] + rows[1], section
    assert re.search(r"100 → checkpoint-200 .*×1\.003$", "\n".join(rows), re.M), section
    assert re.search(r"200 → checkpoint-300 .*×0\.997\d*$", "\n".join(rows), re.M), section
    assert not any(re.search(r"×1$", line) for line in rows)


def test_from_zero_and_to_zero_are_named():
    from tclip.cli.render.summary import _ratio

    assert _ratio({"kind": "from_zero", "ratio": float("inf")}, "×") == "from 0"
    assert _ratio({"kind": "to_zero", "ratio": 0.0}, "×") == "to 0"
    assert _ratio({"kind": "ratio", "ratio": 9617.2}, "×") == "×9,617"
    assert _ratio({"kind": "ratio", "ratio": 0.9999}, "×") == "×0.9999"
    assert _ratio({"kind": "ratio", "ratio": 3.2e9}, "×") == "×3.2e+09"


LAYER_NAMES = [f"model.layers.{i}.post_attention_layernorm.weight" for i in (7, 17)]


def test_a_layer_number_is_never_cut_nor_left_after_an_ellipsis():
    for name in LAYER_NAMES:
        assert essential(name) == name.replace("model.", "…")  # "…layers.7.…": never "…7.", which reads as 17
    shown = shorten_names(LAYER_NAMES, 36)
    assert len(set(shown.values())) == 2
    for text in shown.values():
        assert not re.search(r"…\d", text), shown
    for width in range(8, 40):  # below what tells it apart too: the tail is never cut inside a number
        assert not re.search(r"…\d", abbreviate(LAYER_NAMES[0], width)), width


@pytest.mark.parametrize("width", [80, 120])
def test_summary_names_at_width_never_read_as_another_layer(tmp_path, width):
    edits = {200: {LAYER_NAMES[0]: 50.0}, 300: {LAYER_NAMES[1]: 50.0}}
    text = rendered(write_steps(tmp_path, edits, steps=(100, 200, 300)), width)
    assert not re.search(r"…\d", text), text
    assert re.search(r"layers\.7\.\S*post_attention_layernorm", text) and re.search(
        r"layers\.17\.\S*post_attention_layernorm", text), text


@given(st.lists(st.sampled_from(["model", "layers", "17", "7", "h", "0", "post_attention_layernorm", "mlp", "w1"]),
                min_size=2, max_size=8), st.integers(4, 60))
def test_no_ellipsis_is_ever_followed_by_a_digit(parts, width):
    text = abbreviate(".".join(parts), width)
    assert not re.search(r"[…~]\d", text), text
