"""What the tests share: file builders, reference arithmetic, example checkpoints, the CLI runner.

``tests/`` is on ``sys.path`` (tests/conftest.py puts it there), so a test imports
``from support.formats_helpers import safetensors_bytes`` from whichever folder it is in.
"""

from __future__ import annotations

from pathlib import Path

TESTS = Path(__file__).resolve().parent.parent
"""The tests/ folder: fixtures/, reference/ and support/ are found from here, not from a test's own folder."""
ROOT = TESTS.parent
"""The repository's root (README.md, docs/, samples/, pyproject.toml)."""
FIXTURES = TESTS / "fixtures"
