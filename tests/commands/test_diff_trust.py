"""Issue 20 (2, 3, 4, 11) and 21 (7, 10, 11): a diff never says ``same`` over what it did not
compare; integers compare exactly; metadata and attributes are compared; ``--map`` is
checked, suggested when nothing pairs, and matched in linear time."""

from __future__ import annotations

import json
import re

import h5py
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from support.cli import run80 as run
from support.formats_helpers import safetensors_bytes
from tclip.work.mapping import apply_mapping, parse_mapping


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


# ------------------------------------------------------------------ 20.2 what was not compared


LLAMA = [f"model.layers.{i}.{part}" for i in range(24) for part in
         ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight", "self_attn.o_proj.weight",
          "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight", "input_layernorm.weight",
          "post_attention_layernorm.weight")] + ["model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"]


def llama_tensors(prefix: str = "") -> dict:
    rng = np.random.default_rng(3)
    return {prefix + name: rng.standard_normal(4).astype(np.float32) for name in LLAMA}


def test_llama_has_219_tensors():
    assert len(LLAMA) == 219


def test_what_could_not_be_compared_is_never_same(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "stored.bin").write_bytes(np.ones(64, np.float32).tobytes())
    for side in ("a", "b"):
        with h5py.File(tmp_path / f"{side}.h5", "w") as f:
            f.create_dataset("model/kernel", data=np.full((4, 4), 0.5, np.float32))
            f.create_dataset("model/lm_head", shape=(64,), dtype="f4", external=[("stored.bin", 0, 256)])
    result = run("diff", tmp_path / "a.h5", tmp_path / "b.h5")
    assert result.exit_code == 3, result.output
    assert not any(line.startswith("same") for line in result.stdout.splitlines())
    assert "not compared: model/lm_head (external storage: its data lives in other files" in result.stdout
    assert "incomplete: 1 compared, 0 differ, 1 not compared" in result.stdout
    data = json.loads(run("diff", "--json", tmp_path / "a.h5", tmp_path / "b.h5").stdout)
    assert data["same"] is False and data["verdict"] == "incomplete" and data["tensors_differing"] == 0
    assert [item["name"] for item in data["not_compared"]] == ["model/lm_head"]
    assert data["not_compared"][0]["reason"].startswith("external storage: its data lives in other files")
    quiet = run("diff", "-q", tmp_path / "a.h5", tmp_path / "b.h5")
    assert quiet.exit_code == 3 and "were not all compared: 1 compared, 0 differ, 1 not compared" in quiet.stderr
    excluded = run("diff", "--exclude", "model/lm_head", tmp_path / "a.h5", tmp_path / "b.h5")
    assert excluded.exit_code == 0 and "same: 1 compared" in excluded.stdout


def test_bool_against_numbers_is_not_same(tmp_path):
    a = write_st(tmp_path / "a.safetensors", {"attention_mask": np.array([True, False])})
    b = write_st(tmp_path / "b.safetensors", {"attention_mask": np.array([1, 0], np.uint8)})
    result = run("diff", a, b)
    assert result.exit_code == 3 and "not compared: attention_mask (bool against numbers)" in result.stdout


def test_not_compared_lines_state_each_reason_once(tmp_path):
    a = write_st(tmp_path / "a.safetensors", {f"model.layers.{i}.mask": np.array([True]) for i in range(40)})
    b = write_st(tmp_path / "b.safetensors", {f"model.layers.{i}.mask": np.array([1], np.int8) for i in range(40)})
    result = run("diff", a, b)
    assert result.exit_code == 3
    lines = [line for line in result.stdout.splitlines() if line.startswith("not compared")]
    assert lines == ["not compared: model.layers.0.mask, model.layers.1.mask, model.layers.2.mask and 37 more "
                     "(bool against numbers)"]


# ------------------------------------------------------------------ 20.3 metadata and attributes


def test_safetensors_metadata_is_compared(tmp_path):
    tensors = llama_tensors()
    a = write_st(tmp_path / "a.safetensors", tensors, {"format": "pt", "step": "41200"})
    b = write_st(tmp_path / "b.safetensors", tensors, {"format": "pt", "step": "41300", "note": "resumed"})
    result = run("diff", a, b)
    assert result.exit_code == 3, result.output
    assert "file metadata: step: 41200  vs  41300" in result.stdout
    assert "file metadata: note: (none)  vs  resumed" in result.stdout
    assert "differ: 219 compared, 0 differ, 2 metadata differences" in result.stdout
    data = json.loads(run("diff", "--json", a, b).stdout)
    assert data["metadata_differences"] == [{"where": None, "key": "step", "a": "41200", "b": "41300"},
                                            {"where": None, "key": "note", "a": None, "b": "resumed"}]
    assert data["same"] is False and data["verdict"] == "differ"
    same = write_st(tmp_path / "c.safetensors", tensors, {"format": "pt", "step": "41200"})
    assert run("diff", a, same).exit_code == 0
    # Narrowed to some tensors, the file's metadata is not what is asked about.
    assert run("diff", "--include", "model.layers.0.*", a, b).exit_code == 0


def test_hdf5_attributes_of_root_groups_and_datasets_are_compared(tmp_path):
    def keras(path, version, units, config):
        with h5py.File(path, "w") as f:
            f.attrs["keras_version"] = version
            f.attrs["model_config"] = config
            group = f.create_group("layers/dense")
            group.attrs["units"] = units
            kernel = group.create_dataset("vars/0", data=np.full((4, 4), 0.5, np.float32))
            kernel.attrs["name"] = "kernel"
        return path

    config = json.dumps({"layers": [{"name": f"dense_{i}", "units": 64} for i in range(200)]})
    changed = config.replace('"dense_150", "units": 64', '"dense_150", "units": 65')
    a = keras(tmp_path / "a.weights.h5", "3.6.0", 64, config)
    b = keras(tmp_path / "b.weights.h5", "3.7.0", np.int64(64), changed)
    with h5py.File(b, "a") as f:
        f["layers/dense/vars/0"].attrs["name"] = "bias"
    data = json.loads(run("diff", "--json", a, b).stdout)
    differences = {(d["where"], d["key"]): (d["a"], d["b"]) for d in data["metadata_differences"]}
    assert set(differences) == {(None, "keras_version"), (None, "model_config"), ("layers/dense/vars/0", "name")}
    assert differences[(None, "keras_version")] == ("3.6.0", "3.7.0")
    assert differences[("layers/dense/vars/0", "name")] == ("kernel", "bias")
    shown_a, shown_b = differences[(None, "model_config")]
    assert len(config) > 5000 and len(shown_a) <= 62 and len(shown_b) <= 62
    assert '"units": 64' in shown_a and '"units": 65' in shown_b and shown_a.startswith("…")
    with h5py.File(b, "a") as f:
        f["layers/dense"].attrs["units"] = 32
    text = run("diff", a, b)
    assert text.exit_code == 3 and "attribute of layers/dense: units: 64  vs  32" in text.stdout
    assert "and 1 more metadata difference (--json lists them)" in text.stdout


def test_a_string_and_a_number_are_told_apart(tmp_path):
    for side, value in (("a", 1), ("b", "1")):
        with h5py.File(tmp_path / f"{side}.h5", "w") as f:
            f.attrs["epoch"] = value
            f.create_dataset("w", data=np.ones(3, np.float32))
    result = run("diff", tmp_path / "a.h5", tmp_path / "b.h5")
    assert result.exit_code == 3 and 'file metadata: epoch: 1  vs  "1"' in result.stdout


def test_formats_without_metadata_have_none_to_compare(tmp_path):
    tensors = llama_tensors()
    a = write_st(tmp_path / "a.safetensors", tensors, {"format": "pt"})
    b = tmp_path / "b.npz"
    np.savez(b, **tensors)
    result = run("diff", a, b)
    assert result.exit_code == 0, result.output
    assert "file metadata not compared: one of the formats holds none" in result.stderr
    h5 = tmp_path / "c.h5"
    with h5py.File(h5, "w") as f:
        f.attrs["format"] = "pt"
        for name, values in tensors.items():
            f.create_dataset(name, data=values)
    assert run("diff", a, h5).exit_code == 0  # the strings a conversion carries
    with h5py.File(h5, "a") as f:
        f.attrs["format"] = "tf"
    assert run("diff", a, h5).exit_code == 3


# ------------------------------------------------------------------ 20.4 names that do not pair


def test_a_ddp_prefix_pairs_nothing_and_the_map_is_suggested(tmp_path):
    a = write_st(tmp_path / "ddp.safetensors", llama_tensors("module."))
    b = write_st(tmp_path / "model.safetensors", llama_tensors())
    result = run("diff", a, b)
    assert result.exit_code == 3
    assert ("no tensor names pair up (A: module.lm_head.weight, module.model.embed_tokens.weight and 217 more; "
            "B: lm_head.weight, model.embed_tokens.weight and 217 more); --map 'module.*=*' would pair 219 of 219"
            ) in result.stderr
    assert "only in A: module.lm_head.weight, module.model.embed_tokens.weight, module.model.layers.0.input_layernorm" \
           ".weight and 216 more" in result.stdout
    assert "differ: 0 compared, 0 differ, 219 only in A, 219 only in B\n" in result.stdout  # no ‖A−B‖ of nothing
    assert run("diff", "--map", "module.*=*", a, b).exit_code == 0
    reverse = run("diff", "-q", b, a)
    assert reverse.exit_code == 3 and "--map '*=module.*' would pair 219 of 219" not in reverse.stderr  # -q: quiet
    reverse = run("diff", b, a)
    assert "--map '*=module.*' would pair 219 of 219" in reverse.stderr
    data = json.loads(run("diff", "--json", a, b).stdout)
    assert any("--map 'module.*=*' would pair 219" in w for w in data["warnings"])


def test_a_rule_or_pattern_matching_nothing_is_named(tmp_path):
    a = write_st(tmp_path / "a.safetensors", llama_tensors())
    result = run("diff", "--map", "transformer.*=model.*", a, a)
    assert result.exit_code == 0
    assert "Warning: " in result.stderr and "--map 'transformer.*=model.*' matches no tensor of A" in result.stderr
    nothing = run("diff", "--include", "encoder.*", a, a)
    assert nothing.exit_code == 3, nothing.output  # nothing compared proves nothing
    assert "pattern 'encoder.*' matches no tensor of A or B" in nothing.stderr
    assert "incomplete: 0 compared" in nothing.stdout


def test_suggested_maps_for_common_renames():
    from tclip.work.mapping import suggest_mapping

    base = [n for n in LLAMA if n.startswith("model.")]
    assert suggest_mapping(["_orig_mod." + n for n in base], base) == ("_orig_mod.*=*", len(base))
    assert suggest_mapping(base, ["transformer." + n[len("model."):] for n in base]) == \
        ("model.*=transformer.*", len(base))
    assert suggest_mapping(["a.w"], ["b.v"]) is None


def test_two_sets_compare_their_index_metadata_but_not_total_size(tmp_path):
    def shard_set(folder, metadata):
        folder.mkdir()
        write_st(folder / "model-00001-of-00001.safetensors", llama_tensors())
        (folder / "model.safetensors.index.json").write_text(json.dumps(
            {"metadata": metadata, "weight_map": {n: "model-00001-of-00001.safetensors" for n in LLAMA}}))
        return folder

    a = shard_set(tmp_path / "a", {"total_size": 3504})
    b = shard_set(tmp_path / "b", {"total_size": 9999})
    assert run("diff", a, b).exit_code == 0
    c = shard_set(tmp_path / "c", {"total_size": 3504, "quantization": "none"})
    result = run("diff", a, c)
    assert result.exit_code == 3 and "file metadata: quantization: (none)  vs  none" in result.stdout
