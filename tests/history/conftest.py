"""Fixtures of the checkpoint-history tests (``report --summary``, its pictures and heatmaps)."""

from __future__ import annotations

import pytest

from support.history import write_run



@pytest.fixture
def run_folder(tmp_path):
    """Step files step_0.safetensors ... step_500.safetensors: steady norms but for a spike and a NaN."""
    return write_run(tmp_path)
