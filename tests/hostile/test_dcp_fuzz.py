"""Mutation fuzzing of DCP checkpoint folders: damaged copies of a folder written by the real
``torch.distributed.checkpoint`` (two gloo ranks, uneven ``Shard(0)``, ``Shard(1)``,
``Replicate()``) and of a Megatron ``torch_dist`` folder, one file damaged at a time (its
``.metadata`` pickle, a ``__R_K.distcp`` of chunk zips, Megatron's ``metadata.json`` and
``common.pt``), through ``info``, ``report``, ``norm --out-dir`` and ``diff``, each in a child
forked from one server (:mod:`support.fuzz_helpers`); and the hostile and broken folders of the
DCP tests (``broken`` in :mod:`support.dcp_helpers`) through the same commands.

Each command ends with 0, 1 or 3 within its time, prints no traceback; a failure (exit 1) is
exactly one ``Error:`` line; the folder is left as it was and nothing is written (a failed
``norm`` leaves no output folder). Cases are fixed (seeded by the file's name and the case
number); ``TCLIP_FUZZ_EXAMPLES=N`` runs N per damaged file.
"""

from __future__ import annotations

import os
import random
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from support.dcp_helpers import make_all
from support.fuzz_helpers import COMMAND_SECONDS, CommandServer, Outcome, Seed, mutate

pytestmark = pytest.mark.slow  # child processes and many commands

CASES = int(os.environ.get("TCLIP_FUZZ_EXAMPLES", "0")) or 2
# (seed folder, file damaged in it)
TARGETS = [("ranks2", ".metadata"), ("ranks2", "__0_0.distcp"), ("ranks2", "__1_0.distcp"),
           ("megatron", ".metadata"), ("megatron", "__0_0.distcp"), ("megatron", "metadata.json"),
           ("megatron", "common.pt")]


@pytest.fixture(scope="module")
def dcp_fuzz(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, CommandServer]]:
    pytest.importorskip("torch")
    root = tmp_path_factory.mktemp("dcp_fuzz")
    make_all(root, ("ranks2", "broken", "megatron"))
    server = CommandServer()
    try:
        yield root, server
    finally:
        server.close()


def snapshot(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


def dcp_problems(outcome: Outcome) -> list[str]:
    found = []
    if outcome.status == -14:
        found.append(f"still running after {COMMAND_SECONDS} s")
    elif outcome.status < 0:
        found.append(f"killed by signal {-outcome.status}")
    elif outcome.status not in (0, 1, 3):
        found.append(f"exit status {outcome.status}")
    for word in ("Traceback", "internal error"):
        if word in outcome.stderr:
            found.append(f"{word!r} on stderr")
    errors = [line for line in outcome.stderr.splitlines() if line.startswith("Error: ")]
    if outcome.status == 1 and len(errors) != 1:
        found.append(f"exit 1 with {len(errors)} Error: lines")
    return found


def run_damaged(root: Path, server: CommandServer, kind: str, target: str, payload: bytes, account: str) -> list[str]:
    """Every command on a copy of ``root/<kind>/ckpt`` whose ``target`` is ``payload``."""
    return run_folder(root, server, root / kind / "ckpt", {target: payload}, f"{kind}/{target} {account}")


def run_folder(root: Path, server: CommandServer, source: Path, files: dict[str, bytes], account: str,
               statuses: dict[str, int] | None = None) -> list[str]:
    """Every command on a copy of ``source`` with ``files`` written into it (``statuses``: each
    command's exit status, by command name)."""
    work = Path(tempfile.mkdtemp(prefix="dcp-", dir=root))
    folder = work / "step-100"
    shutil.copytree(source, folder)
    for target, payload in files.items():
        (folder / target).write_bytes(payload)
    before = snapshot(folder)
    reference = root / "ranks2" / "ckpt" if "broken" in source.parts else source
    found: list[str] = []
    for args in (["info", "step-100"], ["report", "--stats", "step-100"],
                 ["norm", "--clip", "1", "--out-dir", "out", "step-100"], ["diff", "step-100", str(reference)]):
        outcome = server.run(args, work)
        if statuses is not None:
            statuses[args[0]] = outcome.status
        found += [f"{' '.join(args[:3])}: {p}" for p in dcp_problems(outcome)]
        if snapshot(folder) != before:
            found.append(f"{' '.join(args)}: the folder was changed")
        extra = sorted(p.name for p in work.iterdir() if p.name not in ("step-100", "out"))
        if extra:
            found.append(f"{' '.join(args)}: left {extra}")
        out = work / "out"
        if outcome.status == 1 and out.exists() and any(out.rglob("*")):
            found.append(f"{' '.join(args)}: failed, and wrote {sorted(p.name for p in out.rglob('*'))}")
        shutil.rmtree(out, ignore_errors=True)
        if found:
            found.append(f"    stderr: {outcome.stderr.strip()[-600:]}")
            break
    shutil.rmtree(work, ignore_errors=True)
    return [f"{account}:"] + found if found else []


def seed_of(root: Path, kind: str, target: str) -> Seed:
    data = (root / kind / "ckpt" / target).read_bytes()
    return Seed(f"{kind}/{target}", "", data, ((0, len(data)),))


@pytest.mark.parametrize("kind, target", TARGETS)
def test_damaged_dcp_files_end_every_command_cleanly(dcp_fuzz: tuple[Path, CommandServer], kind: str,
                                                     target: str) -> None:
    root, server = dcp_fuzz
    seed = seed_of(root, kind, target)
    found = []
    for number in range(CASES):
        payload, account = mutate(seed, random.Random(f"dcp/{kind}/{target}/{number}"))
        found += run_damaged(root, server, kind, target, payload, f"case {number} ({account})")
    assert not found, "\n".join(found)


@pytest.mark.parametrize("kind, target", [t for t in TARGETS if t[1] != "common.pt"])
def test_truncated_dcp_files_are_one_error_line(dcp_fuzz: tuple[Path, CommandServer], kind: str, target: str) -> None:
    """A file cut anywhere: the folder is refused (or, for a cut in a chunk's data, the
    command that reads it fails) with one line, never read as if whole."""
    root, server = dcp_fuzz
    data = (root / kind / "ckpt" / target).read_bytes()
    found = run_damaged(root, server, kind, target, data[:len(data) // 2], f"cut at {len(data) // 2}")
    for cut in (1, len(data) // 3, len(data) - 1):
        work = Path(tempfile.mkdtemp(dir=root))
        shutil.copytree(root / kind / "ckpt", work / "step-100")
        (work / "step-100" / target).write_bytes(data[:cut])
        outcome = server.run(["report", "step-100"], work)
        if outcome.status != 1 or dcp_problems(outcome):
            found.append(f"{kind}/{target} cut at {cut}: report exit {outcome.status}, not 1: "
                         f"{outcome.stderr[-300:]}")
        shutil.rmtree(work, ignore_errors=True)
    assert not found, "\n".join(found)


BROKEN = ["overlap", "gap", "missing_file", "escape", "absolute", "past_end", "bytes_overlap", "hostile_chunk",
          "hostile_bytes_item", "hostile_metadata", "truncated"]


@pytest.mark.parametrize("case", BROKEN)
def test_hostile_and_broken_folders_through_every_command(dcp_fuzz: tuple[Path, CommandServer], case: str) -> None:
    """The damaged and hostile folders of the DCP tests (a .metadata naming os.system, a chunk zip
    pickling a payload, overlapping chunks, a missing or escaping file, a truncated .distcp), each
    through every command: nothing run, one Error: line where it fails, nothing written; only the
    item saved as an object that pickles a payload is no error (listed as not a tensor, never read)."""
    root, server = dcp_fuzz
    statuses: dict[str, int] = {}
    found = run_folder(root, server, root / "broken" / case, {}, case, statuses)
    assert not found, "\n".join(found)
    assert not list(root.rglob("PWNED"))
    if case == "hostile_bytes_item":
        assert statuses["report"] == 0, statuses
    else:
        assert statuses["report"] == 1 and statuses["norm"] == 1, statuses
