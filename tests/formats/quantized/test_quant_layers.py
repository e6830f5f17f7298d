"""Quantization is one layer between the formats and the passes: a format lists what is stored,
tclip.quant computes what it means (statistics, values, rescales), and nothing imports back up."""

from __future__ import annotations

import ast
from pathlib import Path

import numpy as np
import pytest

import support
from support import gguf_helpers as gh
from tclip.errors import TclipError
from tclip.formats import open_reader
from tclip.formats.gguf import GgmlStored
from tclip.quant.contract import QuantEncoding, computing
from tclip.quant.ggml.encoding import GgmlBlocks, NotUnderstood
from tclip.quant.view import logical_view, open_logical

SRC = support.ROOT / "src" / "tclip"
LAYERS = ["core", "formats", "quant", "work", "cli"]


def imported_modules(path: Path) -> set[str]:
    """Every tclip module a file imports (relative imports resolved), at any depth of the file."""
    package = ["tclip", *path.relative_to(SRC).parent.parts]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith("tclip")}
        elif isinstance(node, ast.ImportFrom):
            base = package[:len(package) - node.level + 1] if node.level else []
            module = ".".join(base + ([node.module] if node.module else []))
            found |= {f"{module}.{a.name}" if not node.module else module for a in node.names}
    return {m for m in found if m.startswith("tclip.")}


def layer_of(module: str) -> int | None:
    part = module.split(".")[1]
    return LAYERS.index(part) if part in LAYERS else None


@pytest.mark.parametrize("layer", LAYERS)
def test_no_module_imports_a_layer_above_its_own(layer):
    upward = []
    for path in sorted((SRC / layer).rglob("*.py")):
        for module in imported_modules(path):
            other = layer_of(module)
            if other is not None and other > LAYERS.index(layer):
                upward.append(f"{path.relative_to(SRC)} -> {module}")
    assert upward == []


def test_formats_compute_no_statistics():
    computing_imports = []
    for path in sorted((SRC / "formats").rglob("*.py")):
        for module in imported_modules(path):
            if module.startswith(("tclip.core.kernels", "tclip.core.stats")):
                computing_imports.append(f"{path.relative_to(SRC)} -> {module}")
    assert computing_imports == []


def test_quantization_lives_in_one_package():
    for old in ("core/quant.py", "core/ggml_blocks.py", "formats/quant_layout.py", "formats/quant_encoding.py",
                "formats/gguf.py", "formats/_gguf_header.py"):
        assert not (SRC / old).exists(), old
    assert (SRC / "quant" / "ggml").is_dir() and (SRC / "formats" / "gguf").is_dir()


def test_no_module_of_quant_or_gguf_is_over_700_lines():
    for path in [*(SRC / "quant").rglob("*.py"), *(SRC / "formats" / "gguf").rglob("*.py")]:
        assert len(path.read_text(encoding="utf-8").splitlines()) <= 700, path


def gguf_file(tmp_path: Path) -> Path:
    rng = np.random.default_rng(3)
    tensors = [gh.Tensor("model.layers.17.self_attn.k_proj.weight", (4, 64), gh.TYPE_IDS["Q8_0"],
                         gh.random_blocks(gh.TYPE_IDS["Q8_0"], 8, rng)),
               gh.Tensor("model.layers.17.self_attn.q_proj.weight", (2, 256), gh.TYPE_IDS["IQ2_XXS"],
                         gh.random_blocks(gh.TYPE_IDS["IQ2_XXS"], 2, rng))]
    return gh.write_gguf(tmp_path / "m.gguf", gh.GgufSpec(tensors=tensors))


def test_the_gguf_reader_lists_blocks_tagged_with_their_ggml_type(tmp_path):
    with open_reader(gguf_file(tmp_path)) as reader:
        info = reader.tensors["model.layers.17.self_attn.k_proj.weight"]
        assert isinstance(info.encoding, GgmlStored)
        assert (info.encoding.type_id, info.encoding.type_name, info.nbytes) == (8, "Q8_0", 8 * 34)
        assert not isinstance(info.encoding, QuantEncoding)  # it lists; it does not compute
        with pytest.raises(TclipError, match="nothing decoded"):
            computing(reader, info)


def test_the_quant_view_decodes_what_the_reader_listed(tmp_path):
    with open_logical(gguf_file(tmp_path)) as reader:
        q8 = reader.tensors["model.layers.17.self_attn.k_proj.weight"]
        iq = reader.tensors["model.layers.17.self_attn.q_proj.weight"]
        assert isinstance(q8.encoding, GgmlBlocks) and isinstance(computing(reader, q8), QuantEncoding)
        assert isinstance(iq.encoding, NotUnderstood)
        assert iq.encoding.summary.problem == "ggml type IQ2_XXS is not supported"
        assert q8.nbytes == 8 * 34 and q8.dtype_label == "Q8_0"
        assert logical_view(reader) is reader
