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


# ------------------------------------------------------------------ 21.7 integers compared exactly


def diff_json(tmp_path, a, b, *options):
    np.savez(tmp_path / "a.npz", **a)
    np.savez(tmp_path / "b.npz", **b)
    result = run("diff", "--json", *options, tmp_path / "a.npz", tmp_path / "b.npz")
    assert result.exit_code in (0, 3), result.output
    data = json.loads(result.stdout)
    return result.exit_code, {t["name"]: t for t in data["tensors"]}


def test_int64_beyond_2_53_differ_by_one(tmp_path):
    big = 2**53
    code, tensors = diff_json(tmp_path, {"model.embed_tokens.ids": np.array([big + 1, 5, -big - 1], np.int64)},
                              {"model.embed_tokens.ids": np.array([big, 5, -big], np.int64)})
    t = tensors["model.embed_tokens.ids"]
    assert code == 3 and t["outside"] == 2 and t["elements"] == 3
    assert t["max_abs_diff"] == 1.0 and t["diff_norm"] == 2 ** 0.5


def test_int64_against_a_float_one_past_its_range(tmp_path):
    code, tensors = diff_json(tmp_path, {"step": np.array([2**63 - 1, 2**62], np.int64)},
                              {"step": np.array([2.0**63, 2.0**62], np.float64)})
    t = tensors["step"]
    assert code == 3 and t["outside"] == 1 and t["elements"] == 2 and t["max_abs_diff"] == 1.0
    assert "dtypes differ" in t["note"]


def test_uint64_against_int64(tmp_path):
    code, tensors = diff_json(tmp_path, {"seed": np.array([2**64 - 1, 2**63, 5, 2**53 + 1], np.uint64)},
                              {"seed": np.array([-1, -2**63, 5, 2**53], np.int64)})
    t = tensors["seed"]
    assert code == 3 and t["outside"] == 3 and t["elements"] == 4
    assert t["max_abs_diff"] == 2.0**64  # 2**64 - 1 - (-1), rounded once to float64


@pytest.mark.parametrize("ints, floats, outside, largest", [
    (np.array([3, 2**53 + 1, -7], np.int64), np.array([3.0, 2.0**53, -7.0]), 1, 1.0),
    (np.array([1, 2, 3], np.int32), np.array([1.0, 2.5, 3.0], np.float32), 1, 0.5),
    (np.array([2**40 + 1], np.int64), np.array([2**40 + 1.25]), 1, 0.25),
    (np.array([7, -2**63], np.int64), np.array([7.0, -(2.0**63)]), 0, 0.0),
    (np.array([2**64 - 1], np.uint64), np.array([2.0**64]), 1, 1.0),
])
def test_integers_against_floats_as_exact_values(tmp_path, ints, floats, outside, largest):
    code, tensors = diff_json(tmp_path, {"x": ints}, {"x": floats})
    assert tensors["x"]["outside"] == outside and tensors["x"]["max_abs_diff"] == largest
    assert code == (3 if outside else 0)
    code, tensors = diff_json(tmp_path, {"x": floats}, {"x": ints})  # either side
    assert tensors["x"]["outside"] == outside and tensors["x"]["max_abs_diff"] == largest


def test_integer_tolerance_uses_the_exact_difference(tmp_path):
    a, b = {"n": np.array([2**53 + 1, 2**60], np.int64)}, {"n": np.array([2**53, 2**60 + 3], np.int64)}
    assert diff_json(tmp_path, a, b, "--atol", "3")[0] == 0
    code, tensors = diff_json(tmp_path, a, b, "--atol", "2")
    assert code == 3 and tensors["n"]["outside"] == 1


EXACT_KINDS = [np.int64, np.uint64, np.int32, np.float64, np.float32]


@given(st.sampled_from(EXACT_KINDS), st.sampled_from(EXACT_KINDS),
       st.lists(st.tuples(st.integers(-2**64, 2**64), st.integers(-3, 3)), min_size=1, max_size=8))
@settings(max_examples=300)
def test_compare_unit_counts_and_differences_are_exact(kind_a, kind_b, pairs):
    from fractions import Fraction

    from tclip.core.compare import compare_unit

    def representable(kind, value):
        info = np.iinfo(kind) if np.issubdtype(kind, np.integer) else None
        if info is not None:
            return int(min(max(value, info.min), info.max))
        return float(kind(value))

    a = np.array([representable(kind_a, v) for v, _ in pairs], kind_a)
    b = np.array([representable(kind_b, v + d) if d else representable(kind_b, v) for v, d in pairs], kind_b)
    exact = [Fraction(int(x) if np.issubdtype(kind_a, np.integer) else float(x))
             - Fraction(int(y) if np.issubdtype(kind_b, np.integer) else float(y)) for x, y in zip(a, b)]
    result = compare_unit(a, b, 0.0, 0.0)
    assert result[5] == sum(e != 0 for e in exact)
    assert result[4] == float(max(abs(e) for e in exact))  # the largest difference, rounded once
