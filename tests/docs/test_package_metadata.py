"""What the package says about itself: its description names every format tclip reads."""

from __future__ import annotations

import pytest

import support
from tclip.formats.registry import FORMATS

tomllib = pytest.importorskip("tomllib")  # Python 3.11+

PYPROJECT = support.ROOT / "pyproject.toml"


def test_the_description_names_every_format():
    description = tomllib.loads(PYPROJECT.read_text())["project"]["description"].lower()
    missing = [module.NAME for module in FORMATS if module.NAME.lower() not in description]
    assert not missing, f"pyproject's description leaves out {missing}: {description}"
    assert "quantized" in description
