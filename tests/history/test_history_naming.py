"""How integer-keyed optimizer states get their parameters' names (tclip.work.adam.name_params),
and the interval formula's edge cases, without torch."""

from __future__ import annotations

import math

from tclip.work.adam import OptimizerState, ParamState, _unique_interleaving, interval, name_params

A, B, C = (8, 4), (8,), (2, 8)


def states(shapes: dict[str, tuple[int, ...]]) -> OptimizerState:
    return OptimizerState([ParamState(k, s, 3.0, 1.0, 0.95) for k, s in shapes.items()])


def test_decay_groups_interleave_into_module_order():
    # module order: w0 (A), b0 (B), ln.w (B), ln.b (B), w2 (C), b2 (2,); Trainer's groups: weights, the rest
    model = [("0.weight", A), ("0.bias", B), ("1.weight", B), ("1.bias", B), ("2.weight", C), ("2.bias", (2,))]
    state = states({"0": A, "1": C, "2": B, "3": B, "4": B, "5": (2,)})
    name_params(state, model, True, [["0", "1"], ["2", "3", "4", "5"]])
    assert [p.name for p in state.params] == ["0.weight", "2.weight", "0.bias", "1.weight", "1.bias", "2.bias"]
    assert state.naming is None


def test_an_ambiguous_interleaving_names_only_unique_shapes():
    # a 1-D parameter in each group: which (8,) is whose cannot be told from shapes
    model = [("a.weight", B), ("a.bias", B), ("b.weight", A)]
    state = states({"0": B, "1": A, "2": B})
    name_params(state, model, True, [["0", "1"], ["2"]])
    assert [p.name for p in state.params] == ["param 0 (8)", "b.weight", "param 2 (8)"]
    assert "1 of 3 named" in state.naming


def test_sorted_names_never_name_by_order():
    model = [("0.bias", B), ("0.weight", A), ("1.bias", B), ("1.weight", B)]
    state = states({"0": A, "1": B, "2": B, "3": B})
    name_params(state, model, False, [["0", "1", "2", "3"]])
    assert [p.name for p in state.params] == ["0.weight", "param 1 (8)", "param 2 (8)", "param 3 (8)"]
    assert "sorted by name" in state.naming


def test_the_interleaving_is_found_for_thousands_of_tensors():
    model = [(f"layers.{i}.{kind}", (16, 16) if kind == "weight" else (16,)) for i in range(1500)
             for kind in ("weight", "bias")]
    groups = [[(16, 16)] * 1500, [(16,)] * 1500]
    dealt = _unique_interleaving([s for _, s in model], groups)
    assert dealt == [list(range(0, 3000, 2)), list(range(1, 3000, 2))]
    assert _unique_interleaving([(1,), (1,)], [[(1,)], [(1,)]]) is None  # two ways
    assert _unique_interleaving([(1,), (2,)], [[(2,)], [(3,)]]) is None  # none


def test_interval_edges():
    p = ParamState("0", (2,), 10.0, 4.0, 0.95)
    same = interval(p, p)
    assert same.mean_sq is None and same.norm is None  # no step between two saves of one step
    first = interval(None, p)
    assert math.isclose(first.mean_sq, 4.0 / (1 - 0.95 ** 10), rel_tol=1e-15) and first.conditioning == 1.0
    before = ParamState("0", (2,), 5.0, 1.0, 0.95)
    nan = interval(before, ParamState("0", (2,), 10.0, math.nan, 0.95))
    assert math.isnan(nan.mean_sq) and math.isnan(nan.norm)
    inf = interval(before, ParamState("0", (2,), 10.0, math.inf, 0.95))
    assert inf.mean_sq == math.inf
    # a sum that decayed below b^k V1 (rounding after a spike): clamped at 0 and not trusted
    low = interval(ParamState("0", (2,), 5.0, 1e6, 0.95), ParamState("0", (2,), 6.0, 0.95e6 - 1e-3, 0.95))
    assert low.mean_sq == 0 and low.clamped and not low.trusted
