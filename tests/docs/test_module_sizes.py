"""The architecture limits: no module in src/tclip over 700 lines, no function over 80.

A module's lines are its newline count; a function's run from its ``def`` line to its
last line, docstring included (``ast``'s ``lineno`` to ``end_lineno``).
"""

from __future__ import annotations

import ast
from pathlib import Path

import tclip

MAX_MODULE_LINES = 700
MAX_FUNCTION_LINES = 80
SOURCE = Path(tclip.__file__).resolve().parent


def _modules() -> list[Path]:
    return sorted(SOURCE.rglob("*.py"))


def test_the_source_tree_is_found():
    names = {path.relative_to(SOURCE).as_posix() for path in _modules()}
    assert "core/kernels.py" in names and "formats/dcp/reader.py" in names


def test_no_module_is_over_700_lines():
    long = {path.relative_to(SOURCE).as_posix(): path.read_text(encoding="utf-8").count("\n")
            for path in _modules()}
    assert {name: lines for name, lines in long.items() if lines > MAX_MODULE_LINES} == {}


def test_no_function_is_over_80_lines():
    long = {}
    for path in _modules():
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                if lines > MAX_FUNCTION_LINES:
                    long[f"{path.relative_to(SOURCE).as_posix()}:{node.name}"] = lines
    assert long == {}
