"""The journal of an in-place run over an index is untrusted input (issue 21.8): every field is
checked, and anything but what tclip itself would write is one clean error with nothing touched."""

from __future__ import annotations

import json

import pytest

from support.cli import run
from support.sets import interrupted, sharded
from tclip.core.modes import GlobalNormClip
from tclip.work.options import ClipOptions
from tclip.formats.sharded import TensorSet
from tclip.work.clip import clip_set
from tclip.work import clip as tensorset  # where clipping a set runs its tasks




def first_shard(state):
    return next(iter(state["files"]))


TAMPERED = {
    "nan norm": lambda s: s.update(global_norm="nan"),
    "inf norm": lambda s: s.update(global_norm="inf"),
    "negative norm": lambda s: s.update(global_norm=(-2.5).hex()),
    "norm not in hex": lambda s: s.update(global_norm=12.5),
    "norm missing": lambda s: s.update(global_norm=None),
    "done an object": lambda s: s.update(done={}),
    "done not a list of names": lambda s: s.update(done=[1]),
    "done shard not in the set": lambda s: s.update(done=["model-00009-of-00009.safetensors"]),
    "shard clipped twice": lambda s: s.update(done=[first_shard(s), first_shard(s)]),
    "files entry of one number": lambda s: s["files"].update({first_shard(s): [1]}),
    "files entry of floats": lambda s: s["files"].update({first_shard(s): [1.5, 2.0]}),
    "files entry of bools": lambda s: s["files"].update({first_shard(s): [True, False]}),
    "files entry a string": lambda s: s["files"].update({first_shard(s): "12"}),
    "files a list": lambda s: s.update(files=[]),
    "a shard missing from files": lambda s: s["files"].pop(first_shard(s)),
    "a file not of the set": lambda s: s["files"].update({"../elsewhere.safetensors": [1, 2]}),
    "params of floats": lambda s: s.update(params={"clip": 1.0, "use_norm": None}),
    "an unknown field": lambda s: s.update(extra=1),
    "not an object": lambda s: s.clear() or s.update(x=[]),
}


@pytest.mark.parametrize("case", list(TAMPERED))
def test_a_tampered_journal_is_one_clean_error_and_nothing_changes(tmp_path, monkeypatch, case):
    index, journal = interrupted(tmp_path, monkeypatch)
    state = json.loads(journal.read_text())
    TAMPERED[case](state)
    journal.write_text(json.dumps(state))
    before = {p.name: p.read_bytes() for p in index.parent.iterdir()}
    result = run("global", "--clip", "1", "--in-place", index)
    assert result.exit_code == 1, (result.stdout, result.stderr)
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"Error: {journal}: ")
    assert "journal" in lines[0] and "Traceback" not in result.stderr
    assert {p.name: p.read_bytes() for p in index.parent.iterdir()} == before


def test_a_journal_that_is_not_json_is_refused(tmp_path, monkeypatch):
    index, journal = interrupted(tmp_path, monkeypatch)
    journal.write_text('{"done": [')
    result = run("global", "--clip", "1", "--in-place", index)
    assert result.exit_code == 1 and "journal of an unfinished run is unreadable" in result.stderr


def test_the_journal_names_shards_relative_to_the_index_and_resumes_from_another_folder(tmp_path, monkeypatch):
    index, journal = interrupted(tmp_path, monkeypatch)
    state = json.loads(journal.read_text())
    assert sorted(state["files"]) == sorted(f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3))
    assert state["done"] and set(state["done"]) < set(state["files"])
    assert float.fromhex(state["global_norm"]) > 0
    monkeypatch.chdir(tmp_path / "ckpt")
    result = run("global", "--clip", "1", "--in-place", "--json", "model.safetensors.index.json")
    assert result.exit_code == 0, result.stderr
    assert f"resumed an unfinished run: {len(state['done'])} of 3" in result.stderr
    clean = sharded(tmp_path / "clean")
    assert run("global", "--clip", "1", "--in-place", clean).exit_code == 0
    for shard in clean.parent.glob("*.safetensors"):
        assert (tmp_path / "ckpt" / shard.name).read_bytes() == shard.read_bytes()
