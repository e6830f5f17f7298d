"""The folders users point at around a DCP checkpoint: Megatron-Core ``torch_dist`` (``.metadata``
pickled as ``MCoreMetadata``, ``metadata.json``, ``common.pt``), NeMo 2 (``<ckpt>/weights/``) and
Accelerate FSDP (``<ckpt>/pytorch_model_fsdp_0/`` beside ``optimizer_0/``).

The Megatron folder is written in a child process by the real ``torch.distributed.checkpoint``,
with Megatron's names, its metadata class registered under Megatron's module name (Megatron is not
installable here) and ``common.pt`` pickling ``args`` as an ``argparse.Namespace`` as Megatron does.
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import numpy as np
import pytest

from support.cli import run
from support.dcp_helpers import expected, make_all
from tclip.formats.dcp import Reader
from tclip.formats.torch.pickled import TORCH_DTYPES

QKV = "decoder.layers.self_attention.linear_qkv.weight"


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    pytest.importorskip("torch")
    path = tmp_path_factory.mktemp("dcp_layouts")
    make_all(path, ("single", "ranks2", "megatron"))
    return path


def lines(result) -> list[dict]:  # type: ignore[no-untyped-def]
    return [json.loads(line) for line in result.stdout.splitlines() if line.strip()]


def same_tensors(a: Path, b: Path) -> bool:
    """``diff`` found the same tensors on both sides, all equal (items saved as objects that
    are not plain values stay 'not compared', as in any DCP folder)."""
    result = run("diff", "--json", a, b)
    assert result.exit_code in (0, 3), result.output
    (diff,) = lines(result)
    return diff["tensors_compared"] > 0 and diff["tensors_differing"] == 0 and not diff["only_in_a"] \
        and not diff["only_in_b"]


def megatron_copy(root: Path, target: Path, plain_common: bool = False) -> Path:
    shutil.copytree(root / "megatron" / "ckpt", target)
    if plain_common:
        shutil.copy(root / "megatron" / "common_plain.pt", target / "common.pt")
    return target


# ----------------------------------------------------------------------------- Megatron


def test_megatron_folder_reads_its_tensors_through_mcore_metadata(root: Path) -> None:
    folder, arrays, meta = expected(root, "megatron")
    assert b"MCoreMetadata" in (folder / ".metadata").read_bytes()[:200]
    with Reader(folder) as reader:
        assert set(reader.tensors) == set(meta["tensors"])
        for name, info in meta["tensors"].items():
            want = arrays[name].view(TORCH_DTYPES[info["dtype"]]).reshape(info["shape"])
            assert reader.read(name).tobytes() == want.tobytes(), name
        assert reader.tensors[f"optimizer.state.exp_avg.{QKV}"].optimizer_state


def test_megatron_metadata_json_is_shown_as_metadata(root: Path) -> None:
    result = run("info", "--json", root / "megatron" / "ckpt")
    assert result.exit_code == 0, result.output
    (info,) = lines(result)
    assert info["metadata"]["megatron.sharded_backend"] == "torch_dist"
    assert info["metadata"]["megatron.sharded_backend_version"] == 1
    assert info["metadata"]["dcp_version"] == "1.0.0"


def test_megatron_folder_named_by_its_metadata_json(root: Path) -> None:
    result = run("info", "--json", root / "megatron" / "ckpt" / "metadata.json")
    assert result.exit_code == 0, result.output
    assert QKV in {t["name"] for t in lines(result)[0]["tensors"]}


def test_common_pt_with_a_namespace_is_listed_not_read(root: Path) -> None:
    """A real common.pt pickles args as argparse.Namespace: not read, said so, the weights still are."""
    (info,) = lines(run("info", "--json", root / "megatron" / "ckpt"))
    common = [o for o in info["not_tensors"] if o["name"] == "common.pt"]
    assert len(common) == 1 and "argparse.Namespace" in common[0]["reason"]
    assert common[0]["reason"].startswith("not read")


def test_common_pt_items_are_not_tensors_and_not_measured(root: Path, tmp_path: Path) -> None:
    plain = megatron_copy(root, tmp_path / "plain", plain_common=True)
    bare = megatron_copy(root, tmp_path / "bare")
    (bare / "common.pt").unlink()
    (info,) = lines(run("info", "--json", plain))
    others = {o["name"]: o for o in info["not_tensors"]}
    assert others["common.pt/iteration"]["reason"] == "value 1000"
    assert others["common.pt/rng_tracker_states"]["shape"] == [16]
    assert not any(t["name"].startswith("common.pt") for t in info["tensors"])
    with_common = lines(run("report", "--json", plain))[0]
    without = lines(run("report", "--json", bare))[0]
    assert with_common["global_norm"] == without["global_norm"]
    _, arrays, meta = expected(root, "megatron")
    weights = [n for n in meta["tensors"] if not n.startswith("optimizer.")]
    total = math.sqrt(sum(float(np.sum(np.square(arrays[n].view(TORCH_DTYPES[meta["tensors"][n]["dtype"]])
                                                 .astype(np.float64)))) for n in weights))
    assert with_common["global_norm"] == pytest.approx(total, rel=1e-12)


def test_diff_compares_common_pt_values(root: Path, tmp_path: Path) -> None:
    import subprocess
    import sys

    a = megatron_copy(root, tmp_path / "a", plain_common=True)
    b = megatron_copy(root, tmp_path / "b", plain_common=True)
    script = "import sys, torch; torch.save({'iteration': 1001, 'checkpoint_version': 3.0}, sys.argv[1])"
    subprocess.run([sys.executable, "-c", script, str(b / "common.pt")], check=True, timeout=120)
    result = run("diff", "--json", a, b)
    assert result.exit_code == 3, result.output
    rows = {t["name"]: t for t in lines(result)[0]["tensors"]}
    assert rows["common.pt/iteration"]["differs"] and rows["common.pt/iteration"]["status"] == "compared"
    assert not rows["common.pt/checkpoint_version"]["differs"]
    assert not rows[QKV]["differs"]


def test_a_hostile_common_pt_is_listed_never_run(root: Path, tmp_path: Path) -> None:
    import subprocess
    import sys

    folder = megatron_copy(root, tmp_path / "ckpt")
    marker = tmp_path / "PWNED"
    script = ("import os, sys, torch\n"
              "class P:\n"
              "    def __reduce__(self):\n"
              "        return (os.system, ('touch ' + sys.argv[2],))\n"
              "torch.save({'iteration': 5, 'args': P()}, sys.argv[1])\n")
    subprocess.run([sys.executable, "-c", script, str(folder / "common.pt"), str(marker)], check=True, timeout=120)
    for command in ("info", "report"):
        result = run(command, "--json", folder)
        assert result.exit_code == 0, result.output
        (found,) = lines(result)
        common = [o for o in found["not_tensors"] if o["name"] == "common.pt"]
        assert len(common) == 1 and "system" in common[0]["reason"], common
    assert not marker.exists()


def test_a_huge_metadata_json_is_refused(root: Path, tmp_path: Path) -> None:
    folder = megatron_copy(root, tmp_path / "ckpt")
    (folder / "metadata.json").write_text('{"sharded_backend": "torch_dist", "pad": "' + "x" * (1 << 21) + '"}')
    result = run("info", folder)
    assert result.exit_code == 1 and "metadata.json" in result.stderr and "larger" in result.stderr, result.output


@pytest.mark.parametrize("config, said", [
    ('{"sharded_backend": "zarr", "sharded_backend_version": 1}', "sharded_backend 'zarr'"),
    ('{"sharded_backend": 7}', "sharded_backend is a JSON int"),
    ('{"sharded_backend": "torch_dist", "sharded_backend_version": "1"}', "sharded_backend_version is a JSON str"),
    ('{"sharded_backend": "torch_dist", "common_backend": "zarr"}', "common_backend 'zarr'"),
    ('["sharded_backend"]', "expected an object"),
    ('{"sharded_backend": "torch_dist", ', "not valid JSON"),
])
def test_a_bad_metadata_json_is_one_error_line(root: Path, tmp_path: Path, config: str, said: str) -> None:
    folder = megatron_copy(root, tmp_path / "ckpt")
    (folder / "metadata.json").write_text(config)
    before = sorted(p.name for p in folder.iterdir())
    for command in ("info", "report"):
        result = run(command, folder)
        assert result.exit_code == 1, result.output
        errors = [line for line in result.stderr.splitlines() if line.startswith("Error:")]
        assert len(errors) == 1 and said in errors[0] and "metadata.json" in errors[0], result.stderr
        assert "Traceback" not in result.output
    assert sorted(p.name for p in folder.iterdir()) == before


def test_a_zarr_checkpoint_folder_is_one_error_line(tmp_path: Path) -> None:
    """A Megatron zarr folder (no .metadata): refused by what its metadata.json says."""
    folder = tmp_path / "iter_0000100"
    (folder / "decoder.weight").mkdir(parents=True)
    (folder / "metadata.json").write_text('{"sharded_backend": "zarr", "sharded_backend_version": 1}')
    for target in (folder, folder / "metadata.json", tmp_path):
        result = run("info", target)
        assert result.exit_code == 1, result.output
        assert "sharded_backend 'zarr'" in result.stderr and "Traceback" not in result.output


# ----------------------------------------------------------------------------- NeMo 2, Accelerate


def nemo(root: Path, target: Path) -> Path:
    megatron_copy(root, target / "weights")
    (target / "context").mkdir()
    (target / "context" / "model.yaml").write_text("_target_: nemo.collections.llm.GPTModel\n")
    (target / "context" / "io.json").write_text("{}")
    return target


def test_nemo_checkpoint_folder_reads_its_weights(root: Path, tmp_path: Path) -> None:
    ckpt = nemo(root, tmp_path / "step=100-consumed_samples=800")
    result = run("info", "--json", ckpt)
    assert result.exit_code == 0, result.output
    (info,) = lines(result)
    assert QKV in {t["name"] for t in info["tensors"]}
    assert info["metadata"]["megatron.sharded_backend"] == "torch_dist"
    assert same_tensors(ckpt, root / "megatron" / "ckpt")


def test_a_folder_of_nemo_checkpoints_is_a_folder_of_steps(root: Path, tmp_path: Path) -> None:
    for step in ("step=100", "step=200"):
        nemo(root, tmp_path / "checkpoints" / step)
    result = run("report", "--summary", "--json", tmp_path / "checkpoints")
    assert result.exit_code == 0, result.output
    files = lines(result)
    assert [Path(f["file"]).parent.name for f in files] == ["step=100", "step=200"]
    assert {t["name"] for t in files[1]["norms"]} == set(expected(root, "megatron")[2]["tensors"])


def accelerate(root: Path, target: Path) -> Path:
    shutil.copytree(expected(root, "single")[0], target / "pytorch_model_fsdp_0")
    shutil.copytree(expected(root, "ranks2")[0], target / "optimizer_0")
    (target / "random_states_0.pkl").write_bytes(b"\x80\x04N.")
    return target


def test_accelerate_checkpoint_folder_reads_the_model(root: Path, tmp_path: Path) -> None:
    ckpt = accelerate(root, tmp_path / "checkpoint-500")
    result = run("info", "--json", ckpt)
    assert result.exit_code == 0, result.output
    infos = lines(result)
    assert len(infos) == 1
    assert set(t["name"] for t in infos[0]["tensors"]) == set(expected(root, "single")[2]["tensors"])
    assert "optimizer_0/" in result.stderr  # left out, and said so
    other = accelerate(root, tmp_path / "copy" / "checkpoint-500")
    assert same_tensors(ckpt, other)


def test_accelerate_steps_are_compared_model_to_model(root: Path, tmp_path: Path) -> None:
    for step in ("checkpoint-1", "checkpoint-2"):
        accelerate(root, tmp_path / "out" / step)
    result = run("report", "--summary", "--json", str(tmp_path / "out" / "checkpoint-*"))
    assert result.exit_code == 0, result.output
    files = lines(result)
    assert [Path(f["file"]).parent.name for f in files] == ["checkpoint-1", "checkpoint-2"]
    model = set(expected(root, "single")[2]["tensors"])
    assert all({t["name"] for t in f["norms"]} <= model for f in files)  # the optimizer_0 folder left
    assert not files[1]["changes"]  # the same model twice: nothing changed


def test_with_recursive_every_dcp_folder_below_is_read(root: Path, tmp_path: Path) -> None:
    accelerate(root, tmp_path / "out" / "checkpoint-1")
    result = run("info", "--json", "-r", tmp_path / "out")
    assert result.exit_code == 0, result.output
    assert sorted(Path(f["file"]).parent.name for f in lines(result)) == ["optimizer_0", "pytorch_model_fsdp_0"]


def test_convert_leaves_megatron_files_out_of_the_output(root: Path, tmp_path: Path) -> None:
    """metadata.json beside the safetensors would make Megatron take the output for a torch_dist
    checkpoint; common.pt is the checkpoint's own state, not a side file like config.json."""
    folder = megatron_copy(root, tmp_path / "iter_0001000", plain_common=True)
    (folder / "config.json").write_text("{}")
    result = run("convert", folder, tmp_path / "hf")
    assert result.exit_code == 0, result.output
    assert sorted(p.name for p in (tmp_path / "hf").iterdir()) == ["config.json", "model.safetensors"]


def test_a_folder_of_files_beside_step_folders(root: Path, tmp_path: Path) -> None:
    """Loose tensor files and DCP step folders in one folder: each is an input."""
    folder = tmp_path / "run"
    shutil.copytree(expected(root, "ranks2")[0], folder / "step-100")
    assert run("convert", folder / "step-100", folder / "consolidated.safetensors").exit_code == 0
    result = run("info", "--json", folder)
    assert result.exit_code == 0, result.output
    assert sorted(Path(f["file"]).name for f in lines(result)) == [".metadata", "consolidated.safetensors"]
