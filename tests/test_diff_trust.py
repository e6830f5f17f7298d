"""Issue 20 (2, 3, 4, 11) and 21 (7, 10, 11): a diff never says ``same`` over what it did not
compare; integers compare exactly; metadata and attributes are compared; ``--map`` is
checked, suggested when nothing pairs, and matched in linear time."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest
from click.testing import CliRunner
from formats_helpers import safetensors_bytes
from hypothesis import given, settings
from hypothesis import strategies as st

from tclip.cli import cli
from tclip.diff import apply_mapping, parse_mapping


def run(*args):
    return CliRunner().invoke(cli, [str(a) for a in args], env={"COLUMNS": "80"})


def write_st(path, tensors, metadata=None):
    path.write_bytes(safetensors_bytes(tensors, metadata))
    return path


# ------------------------------------------------------------------ 21.10 tolerances are usage errors


@pytest.mark.parametrize("option, value", [("--rtol", "-1"), ("--atol", "-1"), ("--rtol", "nan"),
                                           ("--atol", "-1e-300"), ("--rtol", "inf")])
def test_bad_tolerances_are_usage_errors(tmp_path, option, value):
    a = write_st(tmp_path / "a.safetensors", {"w": np.ones(3, np.float32)})
    result = run("diff", option, value, a, a)
    assert result.exit_code == 2, result.output
    assert f"Invalid value for '{option}'" in result.stderr and "internal error" not in result.output


# ------------------------------------------------------------------ 21.11 --map in linear time


def backtracking(old: str, name: str) -> list[str] | None:
    """The old matcher: each * a greedy regex group (exponential in the worst case, fine on short names)."""
    match = re.match("".join("(.*)" if c == "*" else re.escape(c) for c in old) + r"\Z", name, re.DOTALL)
    return None if match is None else list(match.groups())


class CountingName(str):
    """A name that counts the searches made in it."""

    searches = 0

    def rfind(self, *args):
        type(self).searches += 1
        return str.rfind(self, *args)

    def find(self, *args):
        type(self).searches += 1
        return str.find(self, *args)


def test_map_on_a_5000_character_name_is_one_search_per_piece():
    rule = parse_mapping(["model.*.*.*.weight=*.*.*.weight"])[0]
    # The backtracking regex took ~70 s on this name (it fails only after trying every split).
    failing = "model." + ".".join(["x"] * 2497) + ".bias"
    assert len(failing) == 5004
    CountingName.searches = 0
    assert rule.apply(CountingName(failing)) is None
    assert CountingName.searches <= 2  # the middle pieces: no backtracking
    matching = "model." + ".".join(f"layers{i}" for i in range(600)) + ".weight"
    CountingName.searches = 0
    assert apply_mapping(CountingName(matching), [rule]) == matching[len("model."):]
    assert CountingName.searches <= 2
    assert rule.captures(matching) == [".".join(f"layers{i}" for i in range(598)), "layers598", "layers599"]


@given(st.text("ab.*", max_size=7), st.text("ab.", max_size=10))
@settings(max_examples=400)
def test_map_captures_what_the_greedy_regex_captured(old, name):
    rule = parse_mapping([f"{old}=x"])[0]
    assert rule.captures(name) == backtracking(old.lstrip("/"), name)


def test_map_renames_as_before(tmp_path):
    rules = parse_mapping(["module.*=*", "enc.*.attn.*=encoder/*/*"])
    assert apply_mapping("module.model.layers.17.self_attn.k_proj.weight", rules) == \
        "model.layers.17.self_attn.k_proj.weight"
    assert apply_mapping("enc.3.attn.q.weight", rules) == "encoder/3/q.weight"
    assert apply_mapping("lm_head.weight", rules) == "lm_head.weight"
    assert parse_mapping(["a=b"])[0].apply("a") == "b" and parse_mapping(["a=b"])[0].apply("ab") is None
