"""Decisions read kinds, never words: rewording every message changes no exit status and no result."""

from __future__ import annotations

import json
import pickle

import ml_dtypes
import numpy as np
import pytest

from support.cli import run
from support.formats_helpers import safetensors_bytes
from tclip import messages
from tclip.cli.words import FLAGS, flag
from tclip.errors import OutputExistsError
from tclip.formats import open_reader
from tclip.messages import Option
from tclip.work.clip import clip_file, report_file
from tclip.work.options import ClipOptions
from tclip.work.selection import Selection
from tclip.work.results import Note, NoteKind
from tclip.work.selection import SkipKind, select

RNG = np.random.default_rng(19)


@pytest.fixture
def mixed(tmp_path):
    """Weights, a bias (rank 1), a step counter and NaN-free values, plus a float64 copy for diff."""
    tensors = {"w": (RNG.standard_normal((6, 5)) * 4).astype(np.float32),
               "b": (RNG.standard_normal(5) * 4).astype(np.float32),
               "step": np.array([7], np.int64),
               "h": RNG.standard_normal((3, 4)).astype(ml_dtypes.bfloat16)}
    (tmp_path / "m.safetensors").write_bytes(safetensors_bytes(tensors))
    np.savez(tmp_path / "m64.npz", **{k: v.astype(np.float64) if v.dtype.kind == "f" or k == "h" else v
                                      for k, v in tensors.items()})
    return tmp_path


def cases(folder):
    m, m64 = folder / "m.safetensors", folder / "m64.npz"
    return [
        ["norm", "--clip", "1", "--axes", "1", "--strict", "--dry-run", m],
        ["norm", "--clip", "1", "--axes", "1", "--json", "--dry-run", m],
        ["norm", "--clip", "1", "--axes", "3", "--dry-run", m],
        ["report", "--max-norm", "0.001", "-q", m],
        ["report", "--max-norm", "100", "--include", "nothing*", m],
        ["report", "--axes", "1", "--json", m],
        ["report", "--axes", "1", m],
        ["diff", m, m64],
        ["diff", "--json", m, m64],
    ]


def outcome(result):
    """What a run decided: exit status, which lines, and JSON without its words."""
    decided: dict = {"exit": result.exit_code, "stderr lines": len(result.stderr.splitlines())}
    if not result.stdout.startswith("{"):  # tables: the lines their kinds choose (the table's own words)
        decided["compared as values"] = "compared as values:" in result.stdout
        decided["measured whole"] = "no slices:" in result.stdout
    else:
        data = json.loads(result.stdout.splitlines()[0])
        decided["tensors"] = [(t["name"], t.get("skipped") is None, t.get("norm"), t.get("clipped"),
                               t.get("status"), t.get("differs")) for t in data.get("tensors", [])]
        decided["warnings"] = len(data.get("warnings", []))
    return decided


def test_rewording_every_message_changes_no_exit_status_and_no_result(mixed, monkeypatch):
    plain = [outcome(run(*args)) for args in cases(mixed)]
    assert [o["exit"] for o in plain] == [1, 0, 1, 3, 1, 0, 0, 0, 0]  # float64 copies: same values
    assert plain[3]["stderr lines"] == 1  # the failed check is shown even with -q
    assert plain[6]["measured whole"] and plain[7]["compared as values"]
    spell = messages.spell
    monkeypatch.setattr(messages, "spell", lambda message, name=messages.library_name:
                        "reworded: " + spell(message, name)[::-1])
    reworded = [outcome(run(*args)) for args in cases(mixed)]
    assert reworded == plain


def test_skip_reasons_are_typed(mixed):
    with open_reader(mixed / "m.safetensors") as reader:
        entries, to_read = select(reader, Selection(exclude=("h",)), axes=(1,), whole_if_rank_skip=True)
    kinds = {e.name: (e.skipped.kind if e.skipped is not None else None) for e in entries}
    assert kinds == {"w": None, "b": SkipKind.AXES, "step": SkipKind.NOT_FLOATING, "h": SkipKind.NOT_SELECTED}
    assert str(entries[[e.name for e in entries].index("b")].skipped) == "rank 1 has no axis 1"
    assert set(to_read) == {"w", "b"}  # the report measures the bias whole
    reason = pickle.loads(pickle.dumps(entries[0].skipped if entries[0].skipped else entries[1].skipped))
    assert reason.kind in SkipKind  # a kind survives the trip to a worker process


def test_dtypes_stay_numpy_dtypes_until_rendered(tmp_path):
    np.save(tmp_path / "be.npy", np.arange(6, dtype=">f4").reshape(2, 3))
    report = report_file(tmp_path / "be.npy")
    assert report.tensors[0].dtype == np.dtype(">f4")
    assert report.to_json()["tensors"][0]["dtype"] == "float32 (big-endian)"


def test_library_messages_name_options_in_library_words(tmp_path):
    assert set(FLAGS) == set(Option)
    assert not any("--" in option.value for option in Option)
    np.save(tmp_path / "a.npy", np.ones(3, np.float32))
    (tmp_path / "a.clipped.npy").write_bytes(b"keep")
    from tclip.core.modes import NormClip

    with pytest.raises(OutputExistsError) as refused:
        clip_file(tmp_path / "a.npy", NormClip(1.0), ClipOptions())
    assert "--" not in str(refused.value) and "pass overwrite=True to replace it" in str(refused.value)
    assert refused.value.spelled(flag).endswith("a.clipped.npy: output already exists; pass --force to replace it")


def test_a_note_keeps_its_kind_and_is_spelled_for_each_audience():
    note = Note(NoteKind.HARD_LINKS, ("the input has 1 other hard link(s); ", Option.IN_PLACE, " gives ..."))
    assert str(note) == "the input has 1 other hard link(s); in_place=True gives ..."
    assert note.spelled(flag) == "the input has 1 other hard link(s); --in-place gives ..."
    copy = pickle.loads(pickle.dumps(note))
    assert copy.kind is NoteKind.HARD_LINKS and copy.spelled(flag) == note.spelled(flag)
