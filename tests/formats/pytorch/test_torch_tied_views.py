"""Views of one storage in a PyTorch file (issue 28, items 1, 5 and 14): each stored element is
counted once in a global norm and a parameter count (tied embeddings, a transpose, a negated view,
a view repeating its own elements), and no rewrite writes what was not reported.

The files come from torch itself, run in a subprocess (tclip never imports torch), or from
tests/support/torch_helpers.py where torch cannot write the layout.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from support import torch_helpers as th
from support.cli import run
import tclip
from tclip.formats import open_reader

pytest.importorskip("torch")


def ok(*args):
    result = run(*args)
    assert result.exit_code == 0, result.stderr
    return result


def as_json(*args) -> dict:
    return json.loads(ok(*args, "--json").stdout)


def torch_script(tmp_path: Path, body: str) -> dict:
    """Run ``body`` with torch in a subprocess in ``tmp_path``; it prints one JSON object."""
    script = "import json, math, torch\ntorch.manual_seed(0)\n" + textwrap.dedent(body)
    result = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout.strip().splitlines()[-1] or "{}")


def tensors_of(report: dict) -> dict[str, dict]:
    return {t["name"]: t for t in report["tensors"]}


# --------------------------------------------------------------------------- item 1: tied weights


TINY_MODEL = """
    from torch import nn
    from safetensors.torch import save_file

    class Decoder(nn.Module):
        def __init__(self):
            super().__init__()
            self.model = nn.Module()
            self.model.embed_tokens = nn.Embedding(96, 24)
            self.model.layers = nn.ModuleList([nn.Module()])
            self.model.layers[0].self_attn = nn.Module()
            self.model.layers[0].self_attn.k_proj = nn.Linear(24, 24)
            self.model.norm = nn.LayerNorm(24)
            self.lm_head = nn.Linear(24, 96, bias=False)
            self.lm_head.weight = self.model.embed_tokens.weight  # tie_word_embeddings

    model = Decoder()
    with torch.no_grad():
        model.model.norm.weight.mul_(3.0)
    state = model.state_dict()
    torch.save(state, "model.pt")
    # what save_pretrained writes: the tie dropped, every tensor its own
    save_file({k: v.contiguous() for k, v in state.items() if k != "lm_head.weight"}, "model.safetensors")
    params = list(model.parameters())
    print(json.dumps({
        "norm": math.sqrt(sum(float(p.double().norm()) ** 2 for p in params)),
        "count": sum(p.numel() for p in params),
    }))
"""


@pytest.fixture(scope="module")
def tied_model(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tied")
    return folder, torch_script(folder, TINY_MODEL)


def test_a_tied_model_has_one_parameter_count_in_every_format(tied_model):
    folder, want = tied_model
    pt = as_json("info", folder / "model.pt")
    st = as_json("info", folder / "model.safetensors")
    assert st["params"] == want["count"]
    assert pt["params"] == want["count"]  # the tied lm_head.weight is not counted again
    assert tensors_of(pt)["lm_head.weight"]["tied_to"] == "model.embed_tokens.weight"
    assert "tied_to" not in tensors_of(pt)["model.embed_tokens.weight"]
    table = ok("info", folder / "model.pt").stdout
    assert "tied: lm_head.weight = model.embed_tokens.weight" in table


def test_a_tied_model_has_one_global_norm_in_every_format(tied_model):
    folder, want = tied_model
    pt = as_json("report", folder / "model.pt")
    st = as_json("report", folder / "model.safetensors")
    assert pt["global_norm"] == st["global_norm"]
    assert pt["global_norm"] == pytest.approx(want["norm"], rel=1e-12)
    rows = tensors_of(pt)
    # per-tensor rows still show each name with its own norm
    assert rows["lm_head.weight"]["norm"] == rows["model.embed_tokens.weight"]["norm"] > 0
    assert rows["lm_head.weight"]["tied_to"] == "model.embed_tokens.weight"
    table = ok("report", folder / "model.pt").stdout
    assert "tied: lm_head.weight = model.embed_tokens.weight" in table
    l1 = [as_json("report", "--ord", "1", folder / name)["global_norm"] for name in ("model.pt", "model.safetensors")]
    assert l1[0] == l1[1]


def test_global_clip_of_a_tied_model_scales_by_the_same_factor_in_every_format(tied_model, tmp_path):
    folder, want = tied_model
    pt = as_json("global", "--clip", "0.5", "-o", tmp_path / "out.pt", folder / "model.pt")
    st = as_json("global", "--clip", "0.5", "-o", tmp_path / "out.safetensors", folder / "model.safetensors")
    assert pt["global_norm"] == st["global_norm"] == pytest.approx(want["norm"], rel=1e-12)
    assert pt["global_norm_after"] == st["global_norm_after"] == pytest.approx(0.5, rel=1e-6)
    scales = {t["name"]: t["scale"] for t in st["tensors"]}
    for row in pt["tensors"]:
        assert row["scale"] == scales.get(row["name"], scales["model.embed_tokens.weight"]), row["name"]
    check = torch_script(tmp_path, """
        from safetensors.torch import load_file
        pt, st = torch.load("out.pt", weights_only=True), load_file("out.safetensors")
        print(json.dumps({
            "tied": pt["lm_head.weight"].data_ptr() == pt["model.embed_tokens.weight"].data_ptr(),
            "equal": all(torch.equal(pt[k], v) for k, v in st.items()),
            "lm_head": torch.equal(pt["lm_head.weight"], st["model.embed_tokens.weight"]),
        }))
    """)
    assert check == {"tied": True, "equal": True, "lm_head": True}


# --------------------------------------------------------------------------- item 14: a weight and its transpose


def test_a_weight_and_its_transpose_take_one_factor(tmp_path):
    # seed 1 gives sums of squares one ulp apart when each view is summed in its own order
    torch_script(tmp_path, """
        g = torch.Generator().manual_seed(1)
        w = torch.randn(64, 48, generator=g)
        torch.save({"model.layers.17.mlp.down_proj.weight": w, "model.layers.17.mlp.down_proj.weight_t": w.t()},
                   "t.pt")
        print("{}")
    """)
    path = tmp_path / "t.pt"
    report = as_json("norm", "--clip", "1", path)
    rows = tensors_of(report)
    a, b = rows["model.layers.17.mlp.down_proj.weight"], rows["model.layers.17.mlp.down_proj.weight_t"]
    assert a["scale"] == b["scale"] < 1 and a["norm"] == b["norm"]
    assert b["tied_to"] == "model.layers.17.mlp.down_proj.weight"
    assert report["global_norm"] == a["norm"]  # the elements are stored once
    with open_reader(tmp_path / "t.clipped.pt") as reader:
        w = reader.read("model.layers.17.mlp.down_proj.weight")
        np.testing.assert_array_equal(reader.read("model.layers.17.mlp.down_proj.weight_t"), w.T)


def test_views_within_a_weight_and_partial_overlaps_count_each_stored_element_once(tmp_path):
    values = np.arange(1, 17, dtype=np.float32)
    wide = values.astype(np.float64)
    path = th.save(tmp_path / "v.pt", {"0": values}, {
        "w": th.contiguous("0", (4, 4)),
        "w.row1": th.View("0", 4, (4,), (1,)),
        "w.col2": th.View("0", 2, (4,), (4,)),
    })
    report = as_json("report", path)
    assert report["global_norm"] == pytest.approx(float(np.linalg.norm(wide)), rel=1e-15)
    rows = tensors_of(report)
    assert rows["w.row1"]["part_of"] == rows["w.col2"]["part_of"] == "w"
    # a row and a column without the weight: they share one element (w[1, 2] = 7)
    apart = as_json("report", "--exclude", "w", path)
    union = np.concatenate([wide[4:8], wide[[2, 10, 14]]])
    assert apart["global_norm"] == pytest.approx(float(np.linalg.norm(union)), rel=1e-15)
    assert as_json("info", path)["params"] == 16
    # the same without the weight in the file: a global clip scales the union by one factor
    crossing = th.save(tmp_path / "x.pt", {"0": values}, {"w.row1": th.View("0", 4, (4,), (1,)),
                                                         "w.col2": th.View("0", 2, (4,), (4,))})
    assert as_json("info", crossing)["params"] == 7
    clipped = as_json("global", "--clip", "1", "-o", tmp_path / "out.pt", crossing)
    assert clipped["global_norm"] == apart["global_norm"]
    row, col = values[4:8], values[[2, 6, 10, 14]]
    want = tclip.clip_by_global_norm([row, col], 1.0, use_norm=apart["global_norm"])[0]
    with open_reader(tmp_path / "out.pt") as reader:
        np.testing.assert_array_equal(reader.read("w.row1"), want[0])
        np.testing.assert_array_equal(reader.read("w.col2"), want[1])
    after = np.concatenate([want[0], want[1][[0, 2, 3]]]).astype(np.float64)
    assert clipped["global_norm_after"] == pytest.approx(float(np.linalg.norm(after)), rel=1e-15)
    assert "overlapping views: w.row1, w.col2" in ok("report", crossing).stdout


# --------------------------------------------------------------------------- item 5: negated and repeating views


@pytest.fixture
def negated(tmp_path):
    torch_script(tmp_path, """
        x = torch.tensor([1.0, 2.0])
        torch.save({"model.x": x, "model.y": torch._neg_view(x)}, "neg.pt")
        print("{}")
    """)
    return tmp_path / "neg.pt"


def test_a_negated_view_reads_negated_and_counts_once(negated):
    report = as_json("report", negated)
    rows = tensors_of(report)
    assert (rows["model.x"]["min"], rows["model.x"]["max"]) == (1.0, 2.0)
    assert (rows["model.y"]["min"], rows["model.y"]["max"]) == (-2.0, -1.0)
    assert rows["model.y"]["tied_to"] == "model.x"
    assert report["global_norm"] == pytest.approx(math.sqrt(5), rel=1e-15)


def test_value_clip_that_a_negated_view_cannot_take_is_refused(negated):
    result = run("value", "--min", "-1", "--max", "2", negated)
    assert result.exit_code == 1
    assert len(result.stderr.splitlines()) == 1
    assert result.stderr.startswith(f"Error: {negated}: ")
    assert "'model.x'" in result.stderr and "'model.y'" in result.stderr and "negat" in result.stderr
    assert sorted(p.name for p in negated.parent.iterdir()) == ["neg.pt"]


def test_value_clip_with_symmetric_bounds_is_exact_on_a_negated_view(negated, tmp_path):
    ok("value", "--min", "-1.5", "--max", "1.5", negated)
    got = torch_script(tmp_path, """
        d = torch.load("neg.clipped.pt", weights_only=True)
        print(json.dumps({k: v.resolve_neg().tolist() for k, v in d.items()}))
    """)
    assert got == {"model.x": [1.0, 1.5], "model.y": [-1.0, -1.5]}


@pytest.fixture
def unfolded(tmp_path):
    torch_script(tmp_path, """
        torch.save({"windows": torch.arange(1.0, 8.0).unfold(0, 4, 1),
                    "rows": torch.tensor([3.0, 4.0, 12.0]).expand(4, 3)}, "u.pt")
        print("{}")
    """)
    return tmp_path / "u.pt"


def test_a_view_repeating_its_elements_is_read_and_counts_each_stored_element_once(unfolded):
    report = as_json("report", unfolded)
    windows = np.lib.stride_tricks.sliding_window_view(np.arange(1, 8, dtype=np.float64), 4)
    rows = tensors_of(report)
    assert rows["windows"]["norm"] == pytest.approx(float(np.linalg.norm(windows)), rel=1e-15)
    assert report["global_norm"] == pytest.approx(math.sqrt(140 + 169), rel=1e-15)  # 1..7 and 3, 4, 12 once
    assert as_json("info", unfolded)["params"] == 7 + 3


def test_per_row_factors_on_a_view_repeating_its_elements_are_refused(unfolded):
    result = run("norm", "--clip", "1", "--axes", "1", "--include", "windows", unfolded)
    assert result.exit_code == 1
    assert len(result.stderr.splitlines()) == 1
    assert "'windows'" in result.stderr and "more than once" in result.stderr
    assert sorted(p.name for p in unfolded.parent.iterdir()) == ["u.pt"]


def test_factors_that_agree_on_every_repeated_element_are_written(unfolded, tmp_path):
    # one factor for the whole view; and identical rows of an expanded vector take identical factors
    ok("norm", "--clip", "1", "--include", "windows", unfolded)
    ok("norm", "--clip", "1", "--axes", "1", "--include", "rows", "-o", tmp_path / "rows.pt", unfolded)
    got = torch_script(tmp_path, """
        a = torch.load("u.clipped.pt", weights_only=True)["windows"]
        b = torch.load("rows.pt", weights_only=True)["rows"]
        print(json.dumps({"windows": a.tolist(), "stride": list(a.stride()), "rows": b.tolist()}))
    """)
    windows = np.lib.stride_tricks.sliding_window_view(np.arange(1, 8, dtype=np.float32), 4)
    np.testing.assert_array_equal(np.array(got["windows"], np.float32), tclip.clip_by_norm(windows, 1.0))
    assert got["stride"] == [1, 1]
    row = tclip.clip_by_norm(np.array([3.0, 4.0, 12.0], np.float32), 1.0)
    np.testing.assert_array_equal(np.array(got["rows"], np.float32), np.broadcast_to(row, (4, 3)))


# --------------------------------------------------------------------------- any views, against brute force


def _random_views(rng: np.random.Generator, size: int) -> dict[str, th.View]:
    views = {}
    for i in range(int(rng.integers(1, 5))):
        ndim = int(rng.integers(1, 4))
        shape = tuple(int(n) for n in rng.integers(1, 5, ndim))
        stride = tuple(int(s) for s in rng.integers(0, 7, ndim))
        if rng.random() < 0.35:  # a dense block (a weight), which others may lie within
            shape = (int(rng.integers(4, 9)), *shape[1:])
            stride = th.contiguous("0", shape).stride
        span = sum((n - 1) * s for n, s in zip(shape, stride)) + 1
        if rng.random() < 0.3 and views:  # the same view again, or its transpose
            base = list(views.values())[int(rng.integers(len(views)))]
            shape, stride = (base.shape[::-1], base.stride[::-1]) if rng.random() < 0.5 else (base.shape, base.stride)
            views[f"layers.{i}.weight"] = th.View("0", base.offset, shape, stride)
            continue
        offset = int(rng.integers(0, size - span + 1))
        views[f"layers.{i}.weight"] = th.View("0", offset, shape, stride, neg=bool(rng.random() < 0.15))
    return views


def _elements(view: th.View) -> list[int]:
    index = np.indices(view.shape).reshape(len(view.shape), -1)
    return (view.offset + np.tensordot(np.array(view.stride), index, axes=1)).tolist()


def test_each_stored_element_is_counted_once_for_any_views(tmp_path):
    from tclip.work.statistics import file_statistics

    rng = np.random.default_rng(28)
    size = 160
    values = rng.standard_normal(size).astype(np.float32)
    for trial in range(150):
        views = _random_views(rng, size)
        path = th.save(tmp_path / f"v{trial}.pt", {"0": values}, views)
        names = list(views)
        sets = {n: _elements(v) for n, v in views.items()}
        with open_reader(path) as reader:
            shared = reader.shared_elements(names)
        for name, first in shared.tied.items():
            assert set(sets[name]) == set(sets[first]), (trial, name)
        for name, whole in shared.part_of.items():
            assert set(sets[name]) <= set(sets[whole]), (trial, name)
        assert set(shared.repeating) == {n for n, s in sets.items() if len(set(s)) < len(s)}, trial
        union = sorted(set().union(*map(set, sets.values())))
        counted = [n for n in names if shared.counted_elsewhere(n) is None]
        assert sum(shared.owned.get(n, len(sets[n])) for n in counted) == len(union), trial
        assert as_json("info", path)["params"] == len(union), trial
        stats = file_statistics(path)
        want = math.fsum(float(values[i]) ** 2 for i in union)
        got = math.fsum(stats.counted_sum_of_squares(n) for n in stats.selected)
        assert got == pytest.approx(want, rel=1e-12), trial


@pytest.mark.parametrize("args", [["global", "--clip", "1"], ["norm", "--clip", "0.5"],
                                  ["norm", "--clip", "0.5", "--axes", "-1"], ["value", "--min", "-0.5", "--max", "0.5"],
                                  ["value", "--min", "-0.2", "--max", "1"]])
def test_any_views_are_written_as_reported_or_refused(tmp_path, args):
    rng = np.random.default_rng(5)
    values = rng.standard_normal(160).astype(np.float32)
    written = 0
    for trial in range(30):
        views = _random_views(rng, 160)
        path = th.save(tmp_path / f"v{trial}.pt", {"0": values}, views)
        out = tmp_path / f"out{trial}.pt"
        result = run(*args, "--json", "-o", out, path)
        if result.exit_code == 1:
            assert len(result.stderr.splitlines()) == 1 and "nothing was written" in result.stderr, result.stderr
            assert not out.exists()
            continue
        assert result.exit_code == 0, result.stderr
        written += 1
        report = json.loads(result.stdout)
        with open_reader(path) as before, open_reader(out) as after:
            for name in views:
                x = before.read(name)
                if args[0] == "global":
                    want = tclip.clip_by_global_norm([x], 1.0, use_norm=report["global_norm"])[0][0]
                elif args[0] == "norm":
                    want = tclip.clip_by_norm(x, 0.5, axes=-1 if "--axes" in args else None)
                else:
                    want = tclip.clip_by_value(x, float(args[2]), float(args[4]))
                np.testing.assert_array_equal(after.read(name), want, err_msg=f"{trial} {name}")
    assert written >= 5  # most files can be clipped


def test_a_sharded_checkpoint_counts_each_stored_element_once(tmp_path):
    values = np.arange(1, 17, dtype=np.float32)
    other = np.full(5, 2.0, np.float32)
    first = th.save(tmp_path / "pytorch_model-00001-of-00002.bin", {"0": values},
                    {"model.layers.0.row": th.View("0", 4, (4,), (1,)),
                     "model.layers.0.col": th.View("0", 2, (4,), (4,))})
    second = th.save_arrays(tmp_path / "pytorch_model-00002-of-00002.bin", {"model.norm.weight": other})
    index = tmp_path / "pytorch_model.bin.index.json"
    index.write_text(json.dumps({"metadata": {"total_size": 0}, "weight_map": {
        "model.layers.0.row": first.name, "model.layers.0.col": first.name, "model.norm.weight": second.name}}))
    union = np.concatenate([values[4:8], values[[2, 10, 14]], other]).astype(np.float64)
    report = as_json("report", index)
    assert report["global_norm"] == pytest.approx(float(np.linalg.norm(union)), rel=1e-15)
    clipped = as_json("global", "--clip", "1", "--out-dir", tmp_path / "out", index)
    assert clipped["global_norm"] == pytest.approx(report["global_norm"], rel=1e-15)
    assert clipped["global_norm_after"] == pytest.approx(1.0, rel=1e-6)
    after = as_json("report", tmp_path / "out" / index.name)
    assert after["global_norm"] == pytest.approx(clipped["global_norm_after"], rel=1e-15)
