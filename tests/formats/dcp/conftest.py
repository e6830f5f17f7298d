"""Folders written per rank by the real ``torch.distributed.checkpoint`` (:mod:`dcp_hf_helpers`),
once a session, for the tests of this folder."""

from __future__ import annotations

from pathlib import Path

import pytest

from support.dcp_hf_helpers import make_all


@pytest.fixture(scope="session")
def hf_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    pytest.importorskip("torch")
    root = tmp_path_factory.mktemp("dcp_hf")
    make_all(root)
    return root
