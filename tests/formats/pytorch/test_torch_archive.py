"""The torch.save reader core: the allowlist pickle interpreter and the archive layouts.

Fixtures under fixtures/torch/ were written by torch (fixtures/make_torch_fixtures.py),
with what torch.load says about them in expected.json / expected.npz, so these tests
run without torch; the ones that compare with a live torch skip when it is missing.
Hostile inputs are assembled here, opcode by opcode.
"""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
import textwrap
import zipfile
import zlib
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import support
from tclip.errors import FormatError, TclipError, UnsupportedError
from tclip.formats.torch.archive import LEGACY_MAGIC, load_torch_archive, read_tensor, sniff_torch
from tclip.formats.torch.unpickler import (
    ACCEPTED_GLOBALS,
    OrderedDictValue,
    PickleLimits,
    StorageRef,
    TensorRef,
    TorchValue,
    flatten,
    load_torch_pickle,
)

FIXTURES = support.FIXTURES / "torch"
EXPECTED = json.loads((FIXTURES / "expected.json").read_text())
with np.load(FIXTURES / "expected.npz") as _npz:
    VALUES = {key: _npz[key] for key in _npz.files}
READABLE = [name for name in EXPECTED if name != "refused"]
REFUSED = EXPECTED["refused"]


# --------------------------------------------------------------------------- assembling pickles

PROTO2 = b"\x80\x02"
EMPTY_ORDERED_DICT = b"ccollections\nOrderedDict\n)R"


def glob(module: str, name: str) -> bytes:
    return b"c" + f"{module}\n{name}\n".encode()


def text(value: str) -> bytes:
    raw = value.encode()
    return b"X" + struct.pack("<I", len(raw)) + raw


def num(value: int) -> bytes:
    if 0 <= value < 256:
        return b"K" + bytes([value])
    if -(1 << 31) <= value < 1 << 31:
        return b"J" + struct.pack("<i", value)
    raw = value.to_bytes((value.bit_length() + 8) // 8, "little", signed=True)
    return b"\x8a" + bytes([len(raw)]) + raw


def tup(*items: bytes) -> bytes:
    return b"(" + b"".join(items) + b"t"


def storage(key: str = "0", numel: int = 4, kind: str = "FloatStorage", module: str = "torch") -> bytes:
    return tup(text("storage"), glob(module, kind), text(key), text("cpu"), num(numel)) + b"Q"


def tensor(key: str = "0", numel: int = 4, shape=(4,), stride=(1,), offset: int = 0, kind: str = "FloatStorage",
           metadata: bytes = b"") -> bytes:
    return glob("torch._utils", "_rebuild_tensor_v2") + tup(
        storage(key, numel, kind), num(offset), tup(*map(num, shape)), tup(*map(num, stride)),
        b"\x89", EMPTY_ORDERED_DICT, metadata) + b"R"


def mapping(*pairs: tuple[str, bytes]) -> bytes:
    return b"}(" + b"".join(text(k) + v for k, v in pairs) + b"u"


def pkl(body: bytes) -> bytes:
    return PROTO2 + body + b"."


def f32(*values: float) -> bytes:
    return np.array(values, "<f4").tobytes()


# --------------------------------------------------------------------------- assembling zips

_LOCAL = struct.Struct("<4s5H3L2H")
_CENTRAL = struct.Struct("<4s6H3L5H2L")


def zip_bytes(members: list[tuple[str, bytes]], overrides: dict[int, dict] | None = None) -> bytes:
    """A zip of stored members, written by hand so tests can make it lie
    (duplicate names, offsets pointing elsewhere, another method in the directory)."""
    body, central = bytearray(), bytearray()
    for index, (name, data) in enumerate(members):
        raw = name.encode()
        entry = {"offset": len(body), "size": len(data), "crc": zlib.crc32(data), "method": 0, "name": raw}
        entry.update((overrides or {}).get(index, {}))
        body += _LOCAL.pack(b"PK\x03\x04", 20, 0, 0, 0, 0x21, zlib.crc32(data), len(data), len(data), len(raw), 0)
        body += raw + data
        central += _CENTRAL.pack(b"PK\x01\x02", 20, 20, 0, entry["method"], 0, 0x21, entry["crc"], entry["size"],
                                 entry["size"], len(entry["name"]), 0, 0, 0, 0, 0, entry["offset"]) + entry["name"]
    end = struct.pack("<4s4H2LH", b"PK\x05\x06", 0, 0, len(members), len(members), len(central), len(body), 0)
    return bytes(body + central + end)


def torch_zip(path: Path, pickle: bytes, storages: dict[str, bytes] | None = None, *, prefix: str = "archive",
              byteorder: bytes | None = b"little", extra: list[tuple[str, bytes]] = (),
              overrides: dict[int, dict] | None = None) -> Path:
    members = [(f"{prefix}/data.pkl", pickle)]
    if byteorder is not None:
        members.append((f"{prefix}/byteorder", byteorder))
    members += [(f"{prefix}/data/{key}", data) for key, data in (storages or {}).items()]
    members += [(f"{prefix}/version", b"3\n"), *extra]
    path.write_bytes(zip_bytes(members, overrides))
    return path


def one_tensor_file(tmp_path: Path, body: bytes, data: bytes = f32(1, 2, 3, 4), **kwargs) -> Path:
    return torch_zip(tmp_path / "t.pt", pkl(mapping(("w", body))), {"0": data}, **kwargs)


def error_of(path: Path, kind: type[Exception] = TclipError) -> str:
    with pytest.raises(kind) as caught:
        load_torch_archive(path)
    message = str(caught.value)
    assert "\n" not in message  # one line for the CLI's "Error:" output
    return message


def plain(value):
    """Tuples used as keys come back as a tuple subclass hashed differently; compare as plain."""
    if isinstance(value, dict):
        return {plain(k): plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [plain(v) for v in value]
    if isinstance(value, tuple):
        return tuple(plain(v) for v in value)
    return value


# --------------------------------------------------------------------------- fixtures written by torch


def _expected_dtype(name: str) -> np.dtype:
    special = {"bfloat16": ml_dtypes.bfloat16, "float8_e4m3fn": ml_dtypes.float8_e4m3fn, "bool": np.bool_}
    return np.dtype(special.get(name, name))


@pytest.mark.parametrize("filename", READABLE)
def test_fixture_views_match_what_torch_load_gave(filename):
    archive = load_torch_archive(FIXTURES / filename)
    expected = EXPECTED[filename]["tensors"]
    assert list(archive.tensors) == list(expected)  # names and order of the saved object
    for name, tensor in archive.tensors.items():
        want = expected[name]
        assert tensor.dtype == _expected_dtype(want["dtype"]), name
        assert list(tensor.shape) == want["shape"], name
        assert list(tensor.stride) == want["stride"], name
        assert tensor.offset == want["offset"], name
        assert tensor.requires_grad is want["requires_grad"], name
        assert tensor.parameter is want["parameter"], name
        assert archive.storages[tensor.storage.key].nbytes == want["storage_nbytes"], name


@pytest.mark.parametrize("filename", READABLE)
def test_fixture_values_are_exactly_torch_loads(filename):
    archive = load_torch_archive(FIXTURES / filename)
    for name in archive.tensors:
        values = read_tensor(archive, name)
        want = VALUES[f"{filename}|{name}"]
        assert values.shape == want.shape, name
        # bfloat16/float8 were widened to float32 by the fixture script: exact
        np.testing.assert_array_equal(values.astype(want.dtype), want, err_msg=name)


@pytest.mark.parametrize("filename", READABLE)
def test_fixture_non_tensors_and_shared_storages(filename):
    archive = load_torch_archive(FIXTURES / filename)
    assert {o.name: o.kind for o in archive.others} == EXPECTED[filename]["others"]
    assert sorted(list(names) for names in archive.shared.values()) == EXPECTED[filename]["shared"]


def test_nested_checkpoint_names_and_scalars():
    archive = load_torch_archive(FIXTURES / "checkpoint.pt")
    assert "model.0.weight" in archive.tensors
    assert "optimizer.state.0.exp_avg" in archive.tensors
    assert archive.tensors["optimizer.state.0.step"].shape == ()
    others = {o.name: (o.kind, o.value) for o in archive.others}
    assert others["step"] == ("int", 5)
    assert others["lr"] == ("float", 1e-3)
    assert others["config.dtype"] == ("dtype", TorchValue("dtype", "bfloat16"))
    assert others["optimizer.param_groups.0.betas"] == ("tuple", (0.9, 0.999))
    assert others["optimizer.param_groups.0.params"] == ("list", [0, 1, 2, 3])
    # a state_dict's per-module versions arrive through BUILD; kept, never set as attributes
    assert archive.root["model"].attributes["_metadata"][""] == {"version": 1}


def test_long_real_names_and_parameter():
    archive = load_torch_archive(FIXTURES / "state_dict.pt")
    k_proj = archive.tensors["model.layers.17.self_attn.k_proj.weight"]
    assert (k_proj.shape, k_proj.stride, k_proj.dtype) == ((8, 4), (4, 1), np.dtype("<f4"))
    bias = archive.tensors["lm_head.bias"]
    assert bias.parameter and bias.requires_grad
    assert archive.tensors["model.rotary.conj"].conj
    assert archive.tensors["model.layers.17.quant.scales"].storage.storage_type == "UntypedStorage"
    assert archive.tensors["model.norm.scale"].shape == ()
    assert archive.tensors["model.empty"].size == 0


def test_storages_are_located_aligned_and_disjoint():
    archive = load_torch_archive(FIXTURES / "state_dict.pt")
    spans = sorted((s.offset, s.offset + s.nbytes) for s in archive.storages.values())
    assert all(offset % 64 == 0 for offset, _ in spans)  # torch.save aligns storages
    assert all(end <= start for (_, end), (start, _) in zip(spans, spans[1:]))
    with zipfile.ZipFile(FIXTURES / "state_dict.pt") as zf, open(FIXTURES / "state_dict.pt", "rb") as f:
        for info in archive.storages.values():
            f.seek(info.offset)
            assert f.read(info.nbytes) == zf.read(info.member)
        offset, size = archive.pickle_member
        f.seek(offset)
        assert f.read(size) == zf.read("state_dict/data.pkl")
    assert (archive.format, archive.prefix, archive.byteorder, archive.version) == ("zip", "state_dict", "little", "3")


def test_views_that_are_dense_runs():
    tensors = load_torch_archive(FIXTURES / "views.pt").tensors
    assert tensors["base"].order() == (0, 1)
    assert tensors["base_row"].order() == (0,)
    assert tensors["base_t"].order() == (1, 0)           # a transposed dense block
    assert tensors["cube_perm"].order() == (1, 2, 0)
    assert tensors["base_slice"].order() is None         # rows with gaps
    assert tensors["base_col"].order() is None
    assert tensors["expanded"].order() is None           # stride 0: repeats elements
    assert tensors["base_slice"].span() == (10, 29)
    assert tensors["attn.v"].span() == (32, 48)
    assert tensors["embed.weight"] == tensors["lm_head.weight"]


@given(st.lists(st.integers(1, 4), min_size=1, max_size=4), st.randoms(use_true_random=False))
def test_order_recovers_any_permuted_dense_block(shape, random):
    perm = list(range(len(shape)))
    random.shuffle(perm)
    dense = np.arange(int(np.prod(shape)), dtype=np.int64).reshape(shape)
    view = dense.transpose(perm)
    ref = TensorRef(StorageRef("0", np.dtype("<i8"), dense.size, "cpu", "LongStorage"), np.dtype("<i8"), 0,
                    view.shape, tuple(s // 8 for s in view.strides))
    order = ref.order()
    assert order is not None
    rebuilt = np.arange(dense.size).reshape([view.shape[i] for i in order]).transpose(np.argsort(order))
    np.testing.assert_array_equal(rebuilt, view)


def test_single_tensor_is_named_by_the_file():
    assert list(load_torch_archive(FIXTURES / "single.pt").tensors) == ["single"]
    assert list(load_torch_archive(FIXTURES / "single.pt", root_name="g").tensors) == ["g"]


def test_protocol5_and_archive_prefix():
    archive = load_torch_archive(FIXTURES / "protocol5.pt")
    assert {o.name: o.value for o in archive.others} == {"b": b"raw bytes", "s": {1, 2}}
    assert load_torch_archive(FIXTURES / "archive_prefix.pt").prefix == "archive"


def test_legacy_format_is_read():
    archive = load_torch_archive(FIXTURES / "legacy.pt")
    assert archive.format == "legacy"
    assert archive.storages[archive.tensors["base"].storage.key].member is None
    assert archive.shared  # tied weights survive the legacy format too


# --------------------------------------------------------------------------- refused files


@pytest.mark.parametrize("filename", sorted(REFUSED))
def test_refused_fixtures_never_run(filename, tmp_path, monkeypatch):
    marker = tmp_path / "payload-ran"
    monkeypatch.setenv("TCLIP_PAYLOAD_MARKER", str(marker))
    message = error_of(FIXTURES / filename, UnsupportedError)
    assert REFUSED[filename] in message
    assert "state_dict" in message
    assert not marker.exists()


def test_payload_fixture_is_live(tmp_path):
    """The payload fixture really runs a command when unpickled (so the test above means something)."""
    marker = tmp_path / "payload-ran"
    script = textwrap.dedent(f"""
        import io, pickle, zipfile
        data = zipfile.ZipFile({str(FIXTURES / 'payload.pt')!r}).read('payload/data.pkl')
        class Loader(pickle.Unpickler):
            def persistent_load(self, pid):
                return None
            def find_class(self, module, name):
                if module.startswith('torch'):
                    return lambda *args: None
                return super().find_class(module, name)
        Loader(io.BytesIO(data)).load()
    """)
    subprocess.run([sys.executable, "-c", script], check=True, env={**os.environ, "TCLIP_PAYLOAD_MARKER": str(marker)})
    assert marker.exists()


def test_parses_with_torch_import_blocked():
    script = textwrap.dedent(f"""
        import sys
        sys.modules['torch'] = None  # any 'import torch' now fails
        from pathlib import Path
        from tclip.errors import UnsupportedError
        from tclip.formats.torch.archive import load_torch_archive, read_tensor
        here = Path({str(FIXTURES)!r})
        count = 0
        for name in {READABLE!r}:
            archive = load_torch_archive(here / name)
            for tensor in archive.tensors:
                read_tensor(archive, tensor)
                count += 1
        for name in {sorted(REFUSED)!r}:
            try:
                load_torch_archive(here / name)
            except UnsupportedError:
                count += 1
        assert sys.modules['torch'] is None
        print(count)
    """)
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    expected = sum(len(EXPECTED[name]["tensors"]) for name in READABLE) + len(REFUSED)
    assert int(result.stdout) == expected


def test_agrees_with_live_torch():
    torch = pytest.importorskip("torch")

    def tensors_of(value, names=()):
        if isinstance(value, torch.Tensor):
            yield ".".join(names), value
        elif isinstance(value, dict):
            for key, item in value.items():
                yield from tensors_of(item, (*names, str(key)))
        elif isinstance(value, list | tuple):
            for index, item in enumerate(value):
                yield from tensors_of(item, (*names, str(index)))

    for filename in READABLE:
        loaded = torch.load(FIXTURES / filename, weights_only=filename != "protocol5.pt")
        theirs = dict(tensors_of(loaded)) if not isinstance(loaded, torch.Tensor) else {Path(filename).stem: loaded}
        archive = load_torch_archive(FIXTURES / filename)
        assert list(archive.tensors) == list(theirs)
        for name, ref in archive.tensors.items():
            value = theirs[name].detach().resolve_conj()
            assert tuple(value.shape) == ref.shape and value.stride() == ref.stride, name
            assert value.storage_offset() == ref.offset, name
            ours = read_tensor(archive, name)
            if value.dtype in (torch.bfloat16, torch.float8_e4m3fn):
                value = value.float()
            np.testing.assert_array_equal(ours.astype(value.numpy().dtype), value.numpy(), err_msg=name)


# --------------------------------------------------------------------------- hand-made archives


def test_hand_made_archive_reads(tmp_path):
    archive = load_torch_archive(one_tensor_file(tmp_path, tensor(shape=(2, 2), stride=(2, 1))))
    np.testing.assert_array_equal(read_tensor(archive, "w"), [[1, 2], [3, 4]])
    assert archive.prefix == "archive" and archive.pickle_member[0] > 0


def test_big_endian_archive(tmp_path):
    data = np.array([1.5, -2, 3, 4], ">f4").tobytes()
    path = one_tensor_file(tmp_path, tensor(), data, byteorder=b"big")
    archive = load_torch_archive(path)
    assert archive.byteorder == "big"
    assert archive.tensors["w"].dtype == np.dtype(">f4")
    np.testing.assert_array_equal(read_tensor(archive, "w"), [1.5, -2, 3, 4])


def test_big_endian_bfloat16(tmp_path):
    data = np.array([1.5, -2], ml_dtypes.bfloat16).view("<u2").astype(">u2").tobytes()
    path = one_tensor_file(tmp_path, tensor(numel=2, shape=(2,), kind="BFloat16Storage"), data, byteorder=b"big")
    values = read_tensor(load_torch_archive(path), "w")
    np.testing.assert_array_equal(values.astype(np.float32), [1.5, -2])


def test_missing_byteorder_means_little(tmp_path):
    archive = load_torch_archive(one_tensor_file(tmp_path, tensor(), byteorder=None))
    assert archive.byteorder == "little"


@pytest.mark.parametrize("body, data, words", [
    (tensor(numel=8), f32(1, 2, 3, 4), "holds 16 bytes, the pickle declares 8 x float32 = 32 bytes"),
    (tensor(numel=2), f32(1, 2, 3, 4), "holds 16 bytes, the pickle declares 2 x float32 = 8 bytes"),
    (tensor(key="7"), f32(1, 2, 3, 4), "storage '7' named by the pickle has no member 'archive/data/7'"),
    (tensor(shape=(5,)), f32(1, 2, 3, 4), "needs 20 bytes of storage '0', which holds 16"),
    (tensor(offset=1), f32(1, 2, 3, 4), "needs 20 bytes"),
    (tensor(shape=(2, 2), stride=(3, 1)), f32(1, 2, 3, 4), "needs 20 bytes"),
    (tensor(shape=(1 << 40,), stride=(1,)), f32(1, 2, 3, 4), "needs"),
    (tensor(shape=(1 << 40, 1 << 40), stride=(0, 0)), f32(1, 2, 3, 4), "impossibly large"),
    (tensor(shape=(1,) * 65, stride=(1,) * 65), f32(1, 2, 3, 4), "65 dimensions"),
    (tensor(offset=-1), f32(1, 2, 3, 4), "storage offset -1"),
    (tensor(shape=(2,), stride=(-1,)), f32(1, 2, 3, 4), "stride [-1]"),
    (tensor(shape=(-2,), stride=(1,)), f32(1, 2, 3, 4), "size [-2]"),
    (tensor(shape=(2, 2), stride=(1,)), f32(1, 2, 3, 4), "differ in length"),
])
def test_views_and_storages_that_do_not_fit(tmp_path, body, data, words):
    assert words in error_of(one_tensor_file(tmp_path, body, data), FormatError)


def test_stride_zero_view_within_its_storage_is_fine(tmp_path):
    archive = load_torch_archive(one_tensor_file(tmp_path, tensor(shape=(1000, 4), stride=(0, 1))))
    assert archive.tensors["w"].size == 4000 and archive.tensors["w"].span() == (0, 4)


def test_untyped_storage_too_small_for_the_dtype(tmp_path):
    body = glob("torch._utils", "_rebuild_tensor_v3") + tup(
        storage(numel=4, kind="UntypedStorage", module="torch.storage"), num(0), tup(num(1)), tup(num(1)),
        b"\x89", EMPTY_ORDERED_DICT, glob("torch", "float64")) + b"R"
    message = error_of(one_tensor_file(tmp_path, body, b"\0" * 4), FormatError)
    assert "needs 8 bytes of storage '0', which holds 4" in message


def test_one_storage_declared_with_two_sizes(tmp_path):
    # CVE-2026-24747-like: the second declaration claims more than the member holds
    pickle = pkl(mapping(("a", tensor(numel=4)), ("b", tensor(numel=1000, shape=(1000,)))))
    path = torch_zip(tmp_path / "t.pt", pickle, {"0": f32(1, 2, 3, 4)})
    assert "storage '0' is declared twice" in error_of(path, FormatError)


def test_truncated_archive(tmp_path):
    path = one_tensor_file(tmp_path, tensor())
    raw = path.read_bytes()
    for cut in (len(raw) - 30, len(raw) // 2, 10):
        path.write_bytes(raw[:cut])
        error_of(path, FormatError)


def test_member_running_past_the_data(tmp_path):
    path = one_tensor_file(tmp_path, tensor(), overrides={2: {"size": 4000}})
    message = error_of(path, TclipError)
    assert "archive/data/0" in message


def test_duplicate_member_names(tmp_path):
    path = one_tensor_file(tmp_path, tensor(), extra=[("archive/data/0", f32(9, 9, 9, 9))])
    assert "two members named 'archive/data/0'" in error_of(path, FormatError)


def test_overlapping_members(tmp_path):
    # member data/1's directory entry points at a local header hidden inside data/0's
    # bytes: two storages would share bytes, and a rewrite would scale them twice
    hidden = _LOCAL.pack(b"PK\x03\x04", 20, 0, 0, 0, 0x21, 0, 8, 8, 14, 0) + b"archive/data/1" + f32(5, 6)
    data0 = f32(1, 2) + hidden
    members = [("archive/data.pkl", pkl(mapping(("a", tensor(numel=len(data0) // 4, shape=(2,))),
                                                ("b", tensor(key="1", numel=2, shape=(2,)))))),
               ("archive/data/0", data0), ("archive/data/1", f32(7, 8))]
    local0 = len(zip_bytes(members[:1]).split(b"PK\x01\x02")[0])  # where data/0's header starts
    inner = local0 + _LOCAL.size + len("archive/data/0") + 8
    path = tmp_path / "t.pt"
    path.write_bytes(zip_bytes(members, {2: {"offset": inner, "crc": 0}}))
    assert "overlap" in error_of(path, FormatError)


def test_local_header_naming_another_member(tmp_path):
    path = one_tensor_file(tmp_path, tensor(), overrides={2: {"offset": 0}})
    assert "local header names 'archive/data.pkl'" in error_of(path, FormatError)


def test_compressed_storage_is_refused(tmp_path):
    path = one_tensor_file(tmp_path, tensor(), overrides={2: {"method": 8}})
    assert "compressed" in error_of(path, UnsupportedError)


def test_damaged_pickle_fails_its_crc(tmp_path):
    path = one_tensor_file(tmp_path, tensor(), overrides={0: {"crc": 1234}})
    assert "CRC-32" in error_of(path, FormatError)


def test_unknown_byteorder(tmp_path):
    assert "unknown byte order" in error_of(one_tensor_file(tmp_path, tensor(), byteorder=b"middle"), FormatError)


def test_duplicate_flattened_names(tmp_path):
    pickle = pkl(mapping(("a.b", tensor()), ("a", mapping(("b", tensor())))))
    path = torch_zip(tmp_path / "t.pt", pickle, {"0": f32(1, 2, 3, 4)})
    assert "flatten to the name 'a.b'" in error_of(path, UnsupportedError)


def test_torchscript_and_other_zips(tmp_path):
    path = torch_zip(tmp_path / "ts.pt", pkl(b"N"), extra=[("archive/constants.pkl", pkl(b")"))])
    assert "TorchScript" in error_of(path, UnsupportedError)
    other = tmp_path / "other.zip"
    other.write_bytes(zip_bytes([("a/b.txt", b"hello")]))
    assert "no member 'a/data.pkl'" in error_of(other, FormatError)


def test_not_a_torch_file(tmp_path):
    for name, content in [("empty.pt", b""), ("text.pt", b"hello world\n"), ("npy.pt", b"\x93NUMPY\x01\x00")]:
        path = tmp_path / name
        path.write_bytes(content)
        assert "not a PyTorch file" in error_of(path, FormatError)
    tar = tmp_path / "old.pt"
    tar.write_bytes(b"\0" * 257 + b"ustar" + b"\0" * 250)
    assert "tar format" in error_of(tar, UnsupportedError)


def test_sniff():
    assert sniff_torch((FIXTURES / "views.pt").read_bytes()[:512]) == "zip"
    assert sniff_torch((FIXTURES / "legacy.pt").read_bytes()[:512]) == "legacy"
    assert sniff_torch(b"\x80\x02K\x05.") is None
    assert sniff_torch(pkl(num(LEGACY_MAGIC))) == "legacy"


def test_legacy_with_a_storage_cut_short(tmp_path):
    raw = (FIXTURES / "legacy.pt").read_bytes()
    path = tmp_path / "legacy.pt"
    path.write_bytes(raw[:-3])
    assert "truncated" in error_of(path, FormatError)


def test_legacy_with_a_wrong_element_count(tmp_path):
    archive = load_torch_archive(FIXTURES / "legacy.pt")
    first = min(archive.storages.values(), key=lambda s: s.offset)
    raw = bytearray((FIXTURES / "legacy.pt").read_bytes())
    raw[first.offset - 8:first.offset] = struct.pack("<q", first.numel + 1)
    path = tmp_path / "legacy.pt"
    path.write_bytes(bytes(raw))
    assert f"holds {first.numel + 1} elements, the pickle declares {first.numel}" in error_of(path, FormatError)


# --------------------------------------------------------------------------- the interpreter: refusals


def _command(marker: Path) -> bytes:
    return text(f"touch {marker}")


PAYLOADS = {
    "os.system": lambda m: glob("os", "system") + tup(_command(m)) + b"R",
    "posix.system": lambda m: glob("posix", "system") + tup(_command(m)) + b"R",
    "builtins.eval": lambda m: glob("builtins", "eval") + tup(text(f"open({str(m)!r}, 'w')")) + b"R",
    "builtins.exec": lambda m: glob("__builtin__", "exec") + tup(text(f"open({str(m)!r}, 'w')")) + b"R",
    "stack global": lambda m: b"\x8c\x05posix\x8c\x06system\x93" + tup(_command(m)) + b"R",
    "getattr chain": lambda m: glob("builtins", "getattr") + tup(glob("os", "path"), text("join")) + b"R",
    "subprocess": lambda m: glob("subprocess", "call") + tup(tup(text("touch"), text(str(m)))) + b"R",
    "torch.load": lambda m: glob("torch", "load") + tup(text(str(m))) + b"R",
    "rebuild_from_type": lambda m: glob("torch._tensor", "_rebuild_from_type_v2") + b")R",
    "numpy reconstruct": lambda m: glob("numpy.core.multiarray", "_reconstruct") + b")R",
    "model class": lambda m: glob("__main__", "Net") + b")\x81",
    "nn module": lambda m: glob("torch.nn.modules.linear", "Linear") + b")\x81",
}


@pytest.mark.parametrize("name", sorted(PAYLOADS))
def test_payload_globals_are_refused_before_anything_runs(name, tmp_path):
    marker = tmp_path / "ran"
    body = PAYLOADS[name](marker)
    pickle = pkl(mapping(("w", tensor()), ("x", body)))
    path = torch_zip(tmp_path / "t.pt", pickle, {"0": f32(1, 2, 3, 4)})
    message = error_of(path, UnsupportedError)
    assert "refused global" in message and "state_dict" in message and "safetensors" in message
    assert not marker.exists()
    # and the same bytes without tclip's archive around them
    with pytest.raises(UnsupportedError):
        load_torch_pickle(pickle)
    assert not marker.exists()


def test_refusal_names_the_global():
    with pytest.raises(UnsupportedError, match=r"refused global 'posix\.system'"):
        load_torch_pickle(pkl(glob("posix", "system") + tup(text("true")) + b"R"))
    with pytest.raises(UnsupportedError, match=r"a model or other Python object saved whole"):
        load_torch_pickle(pkl(glob("__main__", "Net")))
    with pytest.raises(UnsupportedError, match=r"tensor subclass or a tensor with Python attributes"):
        load_torch_pickle(pkl(glob("torch._tensor", "_rebuild_from_type_v2")))


OBJECT_OPCODES = {
    "INST": (b"(ios\nsystem\n", "class os.system (opcode INST)"),
    "OBJ": (b"(" + glob("collections", "OrderedDict") + b"o", "class collections.OrderedDict (opcode OBJ)"),
    "NEWOBJ": (glob("collections", "OrderedDict") + b")\x81", "class collections.OrderedDict (opcode NEWOBJ)"),
    "NEWOBJ_EX": (glob("collections", "OrderedDict") + b")}\x92", "opcode NEWOBJ_EX"),
    "EXT1": (b"\x82\x01", "extension code"),
    "EXT2": (b"\x83\x01\x00", "extension code"),
    "EXT4": (b"\x84\x01\x00\x00\x00", "extension code"),
    "PERSID": (b"Pfoo\n", "text persistent id"),
    "NEXT_BUFFER": (b"\x97", "out-of-band"),
    "READONLY_BUFFER": (b"N\x98", "out-of-band"),
    "reduce a list": (b"])R", "calls a list"),
    "reduce a dtype": (glob("torch", "float32") + b")R", "calls a dtype"),
    "reduce a storage type": (glob("torch", "FloatStorage") + tup(num(4)) + b"R", "only names a value"),
    "bare storage type": (glob("torch", "FloatStorage"), "reference to torch.FloatStorage"),
    "build a dict": (b"}}b", "sets the state of a dict"),
    "build an OrderedDict with a tensor": (EMPTY_ORDERED_DICT + mapping(("t", tensor())) + b"b",
                                          "OrderedDict attributes with state holding a tensor"),
    "module persistent id": (tup(text("module"), num(1), num(2), num(3)) + b"Q", "module saved whole"),
    "other persistent id": (tup(text("rref"), num(1)) + b"Q", "persistent id of type 'rref'"),
    "quantized storage": (tensor(kind="QInt8Storage"), "quantized storage (QInt8Storage)"),
    "tensor dtype without numpy": (glob("torch._utils", "_rebuild_tensor_v3") + tup(
        storage(kind="UntypedStorage"), num(0), tup(num(2)), tup(num(1)), b"\x89", EMPTY_ORDERED_DICT,
        glob("torch", "qint8")) + b"R", "dtype torch.qint8"),  # (complex32 is carried: test_numeric_edges.py)
    "backward hooks": (glob("torch._utils", "_rebuild_tensor_v2") + tup(
        storage(), num(0), tup(num(4)), tup(num(1)), b"\x89", b"}" + text("h") + b"Ns") + b"R", "backward hooks"),
    "tensor metadata": (tensor(metadata=b"}" + text("python_dispatch") + b"\x88s"), "metadata 'python_dispatch'"),
    "codecs rot13": (glob("_codecs", "encode") + tup(text("abc"), text("rot13")) + b"R", "only latin1"),
    "parameter state with a tensor": (glob("torch._utils", "_rebuild_parameter_with_state") + tup(
        tensor(), b"\x88", EMPTY_ORDERED_DICT, b"}" + text("x") + tensor() + b"s") + b"R", "state holding a tensor"),
    "huge int": (b"\x8b" + struct.pack("<i", 1000) + b"\1" * 1000, "integer of 1000 bytes"),
    "colliding int keys": (b"}" + num((1 << 61) - 1) + b"Ns", "dict key 2305843009213693951 is out of range"),
    "list as key": (b"}]Ns", "dict key of type list"),
    "tensor as key": (b"}" + tensor() + b"Ns", "dict key of type tensor"),
}


@pytest.mark.parametrize("name", sorted(OBJECT_OPCODES))
def test_objects_and_calls_are_refused(name):
    body, words = OBJECT_OPCODES[name]
    with pytest.raises(UnsupportedError) as caught:
        list(flatten(load_torch_pickle(pkl(body)).root, budget=1000))
    assert words in str(caught.value)


MALFORMED = {
    "no STOP": (PROTO2 + b"N", "ends without STOP"),
    "empty": (b"", "ends without STOP"),
    "stack underflow": (PROTO2 + b"0.", "no MARK to pop to"),
    "pop of nothing": (PROTO2 + b"t.", "no MARK"),
    "memo read first": (PROTO2 + b"h\x05.", "memo entry 5 read before it is written"),
    "unknown opcode": (PROTO2 + b"\xff.", "unknown opcode 0xff"),
    "odd setitems": (PROTO2 + b"}(Nu.", "odd number"),
    "append to a dict": (PROTO2 + b"}Na.", "APPEND to a dict"),
    "setitem on a list": (PROTO2 + b"]NNs.", "SETITEM on a list"),
    "two values left": (PROTO2 + b"NN.", "2 values on the stack"),
    "mark left open": (PROTO2 + b"(N.", "MARK left open"),
    "unquoted string": (b"Sabc\n.", "not quoted"),
    "protocol 6": (b"\x80\x06N.", "protocol 6"),
    "string longer than the data": (PROTO2 + b"X\xff\xff\xff\xffabc.", "needs 4294967295 bytes"),
    "bytes8 longer than the data": (b"\x80\x04\x8e" + struct.pack("<Q", 1 << 62) + b".", "needs"),
    "frame longer than the data": (b"\x80\x04\x95" + struct.pack("<Q", 1 << 40) + b"N.", "frame of"),
    "negative LONG4": (PROTO2 + b"\x8b\xff\xff\xff\xff.", "negative LONG4"),
    "bad int text": (b"Iabc\n.", "invalid literal"),
    "long int text": (b"I" + b"9" * 5000 + b"\n.", "bad integer"),
    "no newline": (b"Ifoo", "without an end of line"),
    "bad utf-8": (PROTO2 + b"X\x01\x00\x00\x00\xff.", "utf-8"),
    "persistent id with 4 fields": (PROTO2 + tup(text("storage"), glob("torch", "FloatStorage"), text("0"),
                                                 text("cpu")) + b"Q.", "4 fields, expected 5"),
    "storage without a type": (PROTO2 + tup(text("storage"), num(1), text("0"), text("cpu"), num(4)) + b"Q.",
                               "without a storage type"),
    "negative numel": (PROTO2 + storage(numel=-1) + b".", "declares -1 elements"),
    "tensor on a list": (PROTO2 + glob("torch._utils", "_rebuild_tensor_v2") + tup(
        b"]", num(0), tup(num(1)), tup(num(1)), b"\x89", EMPTY_ORDERED_DICT) + b"R.", "not a storage"),
    "tensor with 3 arguments": (PROTO2 + glob("torch._utils", "_rebuild_tensor_v2") + tup(num(1), num(2), num(3))
                                + b"R.", "called with 3 arguments"),
    "requires_grad not bool": (PROTO2 + glob("torch._utils", "_rebuild_tensor_v2") + tup(
        storage(), num(0), tup(num(4)), tup(num(1)), num(1), EMPTY_ORDERED_DICT) + b"R.", "requires_grad is a int"),
}


@pytest.mark.parametrize("name", sorted(MALFORMED))
def test_malformed_pickles(name):
    data, words = MALFORMED[name]
    with pytest.raises(FormatError) as caught:
        load_torch_pickle(data)
    assert words in str(caught.value)
    assert "\n" not in str(caught.value)


# --------------------------------------------------------------------------- the interpreter: values


@pytest.mark.parametrize("protocol", range(6))
def test_plain_values_in_every_protocol(protocol):
    import collections
    import pickle

    value = {
        "ints": [0, 1, 255, 256, 65535, 65536, -1, -(1 << 31), 1 << 31, 1 << 70, -(1 << 70)],
        "floats": [0.5, -0.0, float("inf"), 1e300], "text": ["", "é\u2028\n", "x" * 300],
        "bytes": [b"", b"\x00\xff", b"y" * 300], "flags": [True, False, None],
        "tuples": [(), (1,), (1, 2), (1, 2, 3), (1, 2, 3, 4)], "sets": [set(), {1, "a"}, frozenset({2})],
        "complex": 1 + 2j, "bytearray": bytearray(b"ab"),
        ("tuple", 1): "a tuple key", 1.5: "float key", None: "None key", b"k": "bytes key", 7: "int key",
        "ordered": collections.OrderedDict([("b", 1), ("a", 2)]),
    }
    result = load_torch_pickle(pickle.dumps(value, protocol=protocol)).root
    assert plain(result) == value
    assert isinstance(result["ordered"], OrderedDictValue)
    assert list(result["ordered"]) == ["b", "a"]


def test_shared_references_stay_shared():
    import pickle

    inner = [1, 2]
    result = load_torch_pickle(pickle.dumps({"a": inner, "b": inner}, protocol=2)).root
    assert result["a"] is result["b"]


def test_accepted_globals_are_only_the_allowlist():
    modules = {name.rsplit(".", 1)[0] for name in ACCEPTED_GLOBALS}
    assert modules == {"torch", "torch.cuda", "torch._utils", "torch.storage", "collections", "builtins",
                       "__builtin__", "_codecs"}
    assert "torch._utils._rebuild_tensor_v2" in ACCEPTED_GLOBALS
    assert not {"builtins.eval", "builtins.getattr", "torch.load", "torch.Tensor"} & ACCEPTED_GLOBALS


# --------------------------------------------------------------------------- bombs


def test_deep_nesting_is_refused():
    depth = 100_000
    data = PROTO2 + b"]" * depth + b"a" * (depth - 1) + b"."
    root = load_torch_pickle(data).root
    with pytest.raises(UnsupportedError, match="nested more than 100 deep"):
        list(flatten(root, budget=10**7))


def test_deep_marks_are_refused():
    with pytest.raises(UnsupportedError, match="nests more than 1000 MARKs"):
        load_torch_pickle(PROTO2 + b"(" * 100_000 + b".")


def test_deeply_nested_tuple_keys_are_refused():
    key = b"N" + b"\x85" * 50
    with pytest.raises(UnsupportedError, match="nested more than 8 tuples deep"):
        load_torch_pickle(PROTO2 + b"}" + key + b"Ns.")


def test_billion_laughs_ends_in_the_budget():
    # each list holds the previous one ten times: 10**30 leaves from a 700-byte pickle
    data = PROTO2 + b"]q\x00K\x01a0"
    for level in range(1, 31):
        data += b"](" + (b"h" + bytes([level - 1])) * 10 + b"eq" + bytes([level]) + b"0"
    data += b"h\x1e."
    result = load_torch_pickle(data)
    with pytest.raises(UnsupportedError, match="share sub-trees"):
        list(flatten(result.root, budget=1_000_000))


def test_a_list_holding_itself():
    root = load_torch_pickle(PROTO2 + b"]q\x00h\x00a.").root
    with pytest.raises(UnsupportedError, match="holds itself"):
        list(flatten(root, budget=1000))


def test_memo_and_object_limits():
    puts = PROTO2 + b"N" + b"".join(b"r" + struct.pack("<I", i) for i in range(5000)) + b"."
    with pytest.raises(UnsupportedError, match="more than 1000 memo entries"):
        load_torch_pickle(puts, limits=PickleLimits(max_memo=1000))
    lists = PROTO2 + b"]" * 5000 + b"."
    with pytest.raises(UnsupportedError, match="more than 1000 objects"):
        load_torch_pickle(lists, limits=PickleLimits(max_objects=1000))
    dups = PROTO2 + b"N" + b"2" * 5000 + b"."
    with pytest.raises(UnsupportedError, match="more than 1000 opcodes"):
        load_torch_pickle(dups, limits=PickleLimits(max_ops=1000))


def test_pickle_size_limit(tmp_path):
    path = one_tensor_file(tmp_path, tensor())
    with pytest.raises(UnsupportedError, match="larger than the limit of 100 bytes"):
        load_torch_archive(path, limits=PickleLimits(max_bytes=100))


_M64 = (1 << 64) - 1
_XX1, _XX2, _XX5 = 11400714785074694791, 14029467366897019727, 2870177450012600261


def _colliding_pairs(count: int) -> list[tuple[int, int]]:
    """Pairs (a, b) of small ints whose CPython tuple hashes are all equal (tuples hash
    with xxHash steps that invert: for each a, solve for the b that lands on one state)."""
    def rotl(x, r):
        return ((x << r) | (x >> (64 - r))) & _M64

    target = rotl(12345 * pow(_XX1, -1, 1 << 64) & _M64, 33)  # the state before the last rotation
    pairs, a = [], 0
    while len(pairs) < count:
        a += 1
        state = rotl((_XX5 + a * _XX2) & _M64, 31) * _XX1 & _M64
        lane = (target - state) * pow(_XX2, -1, 1 << 64) & _M64
        b = lane if lane < (1 << 61) - 1 else lane - (1 << 64)
        if abs(b) < (1 << 61) - 1 and b != -1:
            pairs.append((a, b))
    return pairs


def test_tuple_keys_chosen_to_collide_get_distinct_hashes():
    pairs = _colliding_pairs(2000)
    assert len({hash(pair) for pair in pairs}) == 1  # a dict of these would take quadratic time
    body = b"".join(tup(num(a), num(b)) + b"N" for a, b in pairs)
    root = load_torch_pickle(PROTO2 + b"}(" + body + b"u.").root
    assert len(root) == 2000
    assert len({hash(key) for key in root}) == 2000
    assert [tuple(key) for key in root] == pairs


def test_short_lived_tuple_keys_stay_distinct():
    # tuples built, used as a key and dropped at once: their ids are reused by the
    # next ones, which must not be taken for keys already seen
    body = b"".join(num(i) + b"\x85N" + b"s" for i in range(1000))
    root = load_torch_pickle(PROTO2 + b"}" + body + b".").root
    assert plain(root) == {(i,): None for i in range(1000)}


def test_equal_long_keys_become_one_object():
    # two distinct but equal 1 MB strings: after the first insert, every insert of
    # the second must find the key by identity, not by comparing a megabyte again
    long = text("k" * (1 << 20))
    data = (PROTO2 + long + b"q\x000" + long + b"q\x010" + b"}q\x020" + b"}q\x030"
            + b"h\x02h\x00Ns0"                 # one[first] = None
            + b"h\x02h\x01Ns0" * 20_000        # one[second] = None, many times
            + b"h\x03h\x01Ns0"                 # other[second] = None
            + b"(h\x00h\x01h\x02h\x03t.")
    first, second, one, other = load_torch_pickle(data).root
    assert first == second and first is not second
    assert len(one) == 1
    assert next(iter(other)) is first  # the second string became the first object


def test_repeated_build_state_is_walked_once():
    # one big plain state set on an OrderedDict 20 000 times: linear, not 20 000 walks
    state = b"}(" + b"".join(text(f"k{i}") + num(i) for i in range(5000)) + b"uq\x00"
    data = PROTO2 + EMPTY_ORDERED_DICT + state + b"b" + b"h\x00b" * 20_000 + b"."
    root = load_torch_pickle(data).root
    assert isinstance(root, OrderedDictValue) and len(root.attributes) == 5000


def test_calls_repeated_on_one_big_argument_are_refused():
    # set(big list) 100 000 times, five bytes a call: copies the pickle never paid for
    items = b"](" + num(7) * 50_000 + b"eq\x00"
    data = PROTO2 + items + b"0" + (glob("builtins", "set") + b"h\x00\x85R0") * 100_000 + b"N."
    with pytest.raises(UnsupportedError, match="copies more than"):
        load_torch_pickle(data)
