"""Mutation fuzzing of every command over every format (issue 21.13): damaged copies of real files
(.npy, .npz stored and deflated, safetensors, HDF5 contiguous, chunked, compressed, with attributes,
of the newer file format, PyTorch zips with CRC-32s on and off) through `info`, `report`, `norm` and
`diff`, each in its own process.

A command ends with 0, 1 or 3, prints no traceback and no internal error, leaves its input as it was
and nothing but its output beside it (see tests/support/fuzz_helpers.py). The cases are fixed (seeded by the
seed file's name and the case number). CI runs a few per seed file; ``TCLIP_FUZZ_EXAMPLES=N`` runs N
per seed file, and ``python tests/support/fuzz_helpers.py FIRST COUNT`` runs any range outside pytest.
"""

from __future__ import annotations

import os

import pytest

from support.fuzz_helpers import CommandServer, flipped, make_seeds, run_case, run_payload, write_references

SEEDS = ["h5-attributes", "h5-chunked-compressed", "h5-chunked-raw", "h5-latest", "h5-many-chunks",
         "h5-latest-indexes", "npy", "npy-fortran", "npz", "npz-deflated", "pt", "pt-crc-off", "safetensors"]
CASES = int(os.environ.get("TCLIP_FUZZ_EXAMPLES", "0")) or 1

# Cases that once failed, replayed as the bits they flip.
REGRESSIONS = {
    # tclip norm died of SIGSEGV: HDF5 opened the copy of this file for writing and crashed
    # opening a dataset, in tclip's own process.
    "write-crash": ("h5-chunked-raw", [(2931, 5), (11705, 4), (2851, 5), (10051, 6)]),
    # a damaged chunk index listed one chunk twice and another never: KeyError (an internal error)
    "chunk-index": ("h5-chunked-raw", [(10326, 4), (7640, 7)]),
}


pytestmark = pytest.mark.slow  # every command over damaged copies of each seed: minutes


@pytest.fixture(scope="module")
def fuzz(tmp_path_factory):
    folder = tmp_path_factory.mktemp("fuzz")
    seeds = make_seeds(folder)
    references = write_references(seeds, folder / "references")
    server = CommandServer()
    try:
        yield folder, seeds, references, server
    finally:
        server.close()


def test_the_seed_files_are_all_here(fuzz):
    _, seeds, _, _ = fuzz
    assert sorted(seeds) == sorted(SEEDS)


@pytest.mark.parametrize("seed", SEEDS)
def test_damaged_files_end_every_command_cleanly(fuzz, seed):
    folder, seeds, references, server = fuzz
    found = [line for number in range(CASES)
             for line in run_case(seeds[seed], number, server, folder, references[seed])]
    assert not found, "\n".join(found)


@pytest.mark.parametrize("case", list(REGRESSIONS))
def test_damage_that_once_escaped(fuzz, case):
    folder, seeds, references, server = fuzz
    seed, bits = REGRESSIONS[case]
    found = run_payload(seeds[seed], flipped(seeds[seed], bits), case, server, folder, references[seed])
    assert not found, "\n".join(found)
