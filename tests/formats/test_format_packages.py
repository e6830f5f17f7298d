"""A format with helpers is one package (formats/hdf5/, formats/torch/), and the HDF5 child's
command line inside it stays cheap: the CLI imports it before NumPy to start the child early."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from tclip.formats.hdf5 import child


def test_the_hdf5_child_command_line_imports_neither_numpy_nor_h5py_nor_the_formats():
    code = ("import sys\n"
            "from tclip.formats.hdf5.child import HDF5_SUFFIXES, prestart\n"
            "heavy = ('numpy', 'h5py', 'tclip.formats.registry', 'tclip.formats.base',\n"
            "         'tclip.formats.hdf5.reader', 'tclip.formats.hdf5.probe')\n"
            "print(*sorted(m for m in heavy if m in sys.modules))\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.split() == []


def test_the_hdf5_child_runs_the_walk_of_this_package_from_this_source_tree():
    command = child.child_command("read", "model.weights.h5")
    assert command[:4] == [sys.executable, "-I", "-B", "-c"] and command[-2:] == ["read", "model.weights.h5"]
    assert "from tclip.formats.hdf5.walk import main" in command[4]
    source = Path(sys.modules["tclip"].__file__).resolve().parents[1]
    assert f"sys.path.insert(0, {str(source)!r})" in command[4]


def test_the_packages_are_the_formats_the_registry_holds():
    from tclip.formats import hdf5, registry, torch

    assert registry.by_name("hdf5") is hdf5 and registry.by_name("pytorch") is torch
    assert hdf5.Reader is hdf5.Hdf5Reader and hdf5.Writer is hdf5.Hdf5Writer
    assert hdf5.SUFFIXES == child.HDF5_SUFFIXES == (".h5", ".hdf5")
    assert torch.Reader.__module__ == "tclip.formats.torch.reader"


def test_no_module_of_the_format_packages_is_over_700_lines_nor_a_function_over_80():
    import ast

    import tclip.formats

    root = Path(tclip.formats.__file__).parent
    long_modules, long_functions = [], []
    for path in sorted([*(root / "hdf5").glob("*.py"), *(root / "torch").glob("*.py")]):
        text = path.read_text()
        if len(text.splitlines()) > 700:
            long_modules.append(path.name)
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno - node.lineno >= 80:
                long_functions.append(f"{path.parent.name}/{path.name}:{node.name}")
    assert (long_modules, long_functions) == ([], [])
