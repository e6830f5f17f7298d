"""``--dask`` with a scheduler or workers that cannot import tclip: one clear error line."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from support.sets import sharded

pytestmark = pytest.mark.slow  # Dask clusters in child processes

pytest.importorskip("dask.distributed")


def without_tclip(folder: Path) -> dict[str, str]:
    """An environment whose Python finds a ``tclip`` that cannot be imported: a machine without it."""
    stub = folder / "stub" / "tclip"
    stub.mkdir(parents=True)
    (stub / "__init__.py").write_text('raise ImportError("no tclip on this machine")\n')
    return {**os.environ, "PYTHONPATH": str(folder / "stub")}


def start(command: list[str], env: dict[str, str], log: Path) -> subprocess.Popen:
    with open(log, "w") as out:
        return subprocess.Popen([sys.executable, "-m", *command], env=env, stdout=out, stderr=subprocess.STDOUT)


@pytest.mark.parametrize("lacking", ["scheduler", "workers"])
def test_a_cluster_without_tclip_is_one_error_line(tmp_path, lacking):
    index = sharded(tmp_path / "ckpt")
    bare = without_tclip(tmp_path)
    address_file = tmp_path / "scheduler.json"
    processes = [start(["distributed.cli.dask_scheduler", "--host", "127.0.0.1", "--port", "0",
                        "--dashboard-address", ":0", "--scheduler-file", str(address_file)],
                       bare if lacking == "scheduler" else dict(os.environ), tmp_path / "scheduler.log")]
    try:
        deadline = time.monotonic() + 60
        while not address_file.exists() and time.monotonic() < deadline:
            time.sleep(0.2)
        address = json.loads(address_file.read_text())["address"]
        if lacking == "workers":
            processes.append(start(["distributed.cli.dask_worker", address, "--nthreads", "1", "--nworkers", "1"],
                                   bare, tmp_path / "worker.log"))
            while "Registered to" not in (tmp_path / "worker.log").read_text() and time.monotonic() < deadline:
                time.sleep(0.2)
        result = subprocess.run([sys.executable, "-m", "tclip", "global", "--clip", "1", "--dask", address,
                                 "--out-dir", str(tmp_path / "out"), str(index)],
                                capture_output=True, text=True, timeout=120)
    finally:
        for process in processes:
            process.terminate()
            process.wait(timeout=30)
    assert result.returncode == 1
    assert result.stderr.splitlines() == [
        f"Error: the Dask {lacking} at {address} cannot import tclip (ImportError: no tclip on this machine); "
        "tclip must be installed where the scheduler and every worker run too, the same version as here"]
    assert not (tmp_path / "out").exists()
