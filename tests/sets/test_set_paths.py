"""How sets name their files: symlinked shards and indexes, shards in subfolders, one file
under two names, folders holding two indexes (issues 21.15 and 20.18)."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

from support.cli import run
from support.formats_helpers import read_all, safetensors_bytes
from support.sets import TENSORS, all_tensors, sharded
from tclip.core.modes import GlobalNormClip
from tclip.errors import TclipError
from tclip.work.options import ClipOptions
from tclip.formats.sharded import TensorSet
from tclip.work.clip import clip_set
from tclip.work import clip as tensorset  # where clipping a set runs its tasks


def clipped_reference(tmp_path):
    clean = sharded(tmp_path / "clean")
    assert run("global", "--clip", "1", "--in-place", clean).exit_code == 0
    return clean.parent


def test_in_place_through_symlinked_shards_and_index_rewrites_the_targets_and_keeps_the_links(tmp_path):
    """A Hugging Face cache: the snapshot folder holds links into blobs/."""
    origin = sharded(tmp_path / "origin").parent
    blobs, snapshot = tmp_path / "blobs", tmp_path / "snapshot"
    blobs.mkdir()
    snapshot.mkdir()
    for i, file in enumerate(sorted(origin.iterdir())):
        shutil.copyfile(file, blobs / f"blob{i}")
        (snapshot / file.name).symlink_to(blobs / f"blob{i}")
    result = run("global", "--clip", "1", "--in-place", snapshot / "model.safetensors.index.json")
    assert result.exit_code == 0, result.stderr
    reference = clipped_reference(tmp_path)
    for file in sorted(origin.iterdir()):
        assert (snapshot / file.name).is_symlink(), file.name
        assert (snapshot / file.name).read_bytes() == (reference / file.name).read_bytes(), file.name
    assert sorted(p.name for p in snapshot.iterdir()) == sorted(p.name for p in origin.iterdir())
    assert len(list(blobs.iterdir())) == len(list(origin.iterdir()))  # no temp or marker left


def subfolder_checkpoint(folder):
    folder.mkdir(parents=True)
    (folder / "sub").mkdir()
    names = list(TENSORS)
    first, second = names[:7], names[7:]
    (folder / "a.safetensors").write_bytes(safetensors_bytes({n: TENSORS[n] for n in first}))
    (folder / "sub" / "b.safetensors").write_bytes(safetensors_bytes({n: TENSORS[n] for n in second}))
    weight_map = {**{n: "a.safetensors" for n in first}, **{n: "sub/b.safetensors" for n in second}}
    index = folder / "model.safetensors.index.json"
    index.write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return index


def test_shards_in_a_subfolder_go_to_the_same_subfolder_of_the_out_dir(tmp_path):
    index = subfolder_checkpoint(tmp_path / "ckpt")
    result = run("global", "--clip", "1", "--out-dir", tmp_path / "out", index)
    assert result.exit_code == 0, result.stderr
    out = {**read_all(tmp_path / "out" / "a.safetensors"), **read_all(tmp_path / "out" / "sub" / "b.safetensors")}
    total = np.sqrt(sum(np.sum(t.astype(np.float64) ** 2) for t in TENSORS.values()))
    for name, tensor in TENSORS.items():
        np.testing.assert_allclose(out[name], tensor * (1 / total), rtol=1e-6)
    assert json.loads((tmp_path / "out" / index.name).read_text())["weight_map"] == \
        json.loads(index.read_text())["weight_map"]


def test_a_symlinked_subfolder_in_the_out_dir_is_never_written_through(tmp_path):
    index = subfolder_checkpoint(tmp_path / "ckpt")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "sub").symlink_to(elsewhere)
    result = run("global", "--clip", "1", "--force", "--out-dir", tmp_path / "out", index)
    assert result.exit_code == 1
    assert result.stderr == f"Error: {tmp_path / 'out' / 'sub'}: is a symbolic link inside the output folder; " \
                            "shards are written only into folders tclip makes or finds there\n"
    assert list(elsewhere.iterdir()) == [] and sorted(p.name for p in (tmp_path / "out").iterdir()) == ["sub"]


def test_a_failed_run_leaves_nothing_in_the_out_dir(tmp_path):
    index = subfolder_checkpoint(tmp_path / "ckpt")
    # the second shard is cut short: pass 1 reads its header only when it runs
    b = tmp_path / "ckpt" / "sub" / "b.safetensors"
    data = b.read_bytes()
    b.write_bytes(data[:-100])
    (tmp_path / "out").mkdir()
    result = run("global", "--clip", "1", "--out-dir", tmp_path / "out", index)
    assert result.exit_code == 1
    assert result.stderr.startswith("Error: ") and len(result.stderr.splitlines()) == 1
    assert list((tmp_path / "out").iterdir()) == []


def test_a_failed_pass_two_removes_the_shards_it_wrote(tmp_path, monkeypatch):
    index = subfolder_checkpoint(tmp_path / "ckpt")
    real = tensorset.rewrite_task

    def fail_on_b(path, *args, **kwargs):
        if path.endswith("b.safetensors"):
            raise TclipError("disk full", path)
        return real(path, *args, **kwargs)

    monkeypatch.setattr(tensorset, "rewrite_task", fail_on_b)
    (tmp_path / "out").mkdir()
    with pytest.raises(TclipError):
        clip_set(TensorSet(str(index), [], index), GlobalNormClip(1.0),
                 ClipOptions(out_dir=tmp_path / "out", threads=1))
    assert list((tmp_path / "out").iterdir()) == []


def test_one_shard_named_two_ways_is_one_shard(tmp_path):
    index = sharded(tmp_path / "ckpt")
    data = json.loads(index.read_text())
    first = sorted(set(data["weight_map"].values()))[0]
    names = [n for n, shard in data["weight_map"].items() if shard == first]
    data["weight_map"][names[0]] = f"./{first}"
    index.write_text(json.dumps(data))
    info = run("info", "--json", index)
    assert info.exit_code == 0, info.stderr
    assert len(json.loads(info.stdout)["tensors"]) == len(TENSORS)
    result = run("global", "--clip", "1", "--out-dir", tmp_path / "out", index)
    assert result.exit_code == 0, result.stderr
    reference = clipped_reference(tmp_path)
    assert all_tensors(tmp_path / "out").keys() == all_tensors(reference).keys()
    for shard in reference.glob("*.safetensors"):
        assert (tmp_path / "out" / shard.name).read_bytes() == shard.read_bytes()


def test_an_index_naming_one_file_through_a_link_is_refused(tmp_path):
    index = sharded(tmp_path / "ckpt")
    data = json.loads(index.read_text())
    first = sorted(set(data["weight_map"].values()))[0]
    (tmp_path / "ckpt" / "alias.safetensors").symlink_to(first)
    names = [n for n, shard in data["weight_map"].items() if shard == first]
    data["weight_map"][names[0]] = "alias.safetensors"
    index.write_text(json.dumps(data))
    result = run("report", index)
    assert result.exit_code == 1
    assert "the index names one file twice" in result.stderr and "are one file" in result.stderr


def both_indexes(folder):
    index = sharded(folder)
    data = json.loads(index.read_text())
    (folder / "pytorch_model.bin.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": {n: "pytorch_model-00001-of-00001.bin" for n in data["weight_map"]}}))
    return index


def test_a_folder_with_safetensors_and_bin_indexes_takes_the_safetensors_one(tmp_path):
    index = both_indexes(tmp_path / "ckpt")
    report = run("report", "--json", tmp_path / "ckpt")
    assert report.exit_code == 0, report.stderr
    assert [json.loads(line)["file"] for line in report.stdout.splitlines()] == [str(index)]
    assert "using the safetensors index" in report.stderr and "pytorch_model.bin.index.json" in report.stderr
    diff = run("diff", tmp_path / "ckpt", index)
    assert diff.exit_code == 0, diff.stderr
    assert "using the safetensors index" in diff.stderr
    clip = run("global", "--clip", "1", "--out-dir", tmp_path / "out", tmp_path / "ckpt")
    assert clip.exit_code == 0, clip.stderr
    assert "using the safetensors index" in clip.stderr
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == sorted(
        p.name for p in (tmp_path / "ckpt").iterdir() if p.name != "pytorch_model.bin.index.json")


def npz(path, tensors):
    np.savez(path, **tensors)
    return path


def test_across_files_with_one_file_twice_is_an_error(tmp_path, monkeypatch):
    a = npz(tmp_path / "a.npz", {"w": np.ones((3, 4), np.float32)})
    (tmp_path / "link.npz").symlink_to(a)
    monkeypatch.chdir(tmp_path)
    for second in ("a.npz", "./a.npz", str(a), "link.npz"):
        for command in (["report"], ["global", "--clip", "1", "--out-dir", "out"],
                        ["global", "--clip", "1", "--dry-run"]):
            result = run(*command, "--across-files", "a.npz", second)
            assert result.exit_code == 1, (command, second, result.stderr)
            assert "the same file is given twice" in result.stderr, result.stderr
            assert "two files" not in result.stderr
            assert len(result.stderr.splitlines()) == 1
    assert not (tmp_path / "out").exists()


def test_a_folder_with_model_safetensors_and_a_bin_index_takes_model_safetensors(tmp_path):
    # An unsharded safetensors checkpoint beside the sharded .bin set it was converted from:
    # from_pretrained loads model.safetensors, and so does the folder here, with a note.
    folder = tmp_path / "ckpt"
    folder.mkdir()
    single = folder / "model.safetensors"
    single.write_bytes(safetensors_bytes({"model.norm.weight": np.array([3, 4], np.float32)}))
    (folder / "pytorch_model.bin.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": {"model.norm.weight": "pytorch_model-00001-of-00002.bin",
                                        "lm_head.weight": "pytorch_model-00002-of-00002.bin"}}))
    report = run("report", "--json", folder)
    assert report.exit_code == 0, report.stderr
    lines = [json.loads(line) for line in report.stdout.splitlines()]
    assert [line["file"] for line in lines] == [str(single)] and lines[0]["global_norm"] == 5.0
    assert "using model.safetensors" in report.stderr and "pytorch_model.bin.index.json" in report.stderr
    clip = run("global", "--clip", "1", "--out-dir", tmp_path / "out", folder)
    assert clip.exit_code == 0, clip.stderr
    assert (tmp_path / "out" / "model.safetensors").is_file()
