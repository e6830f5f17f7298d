"""The GGUF header parser: the committed fixtures, files of the gguf package, hostile headers."""

from __future__ import annotations

import json
import struct
import time

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import support
from support import gguf_helpers as gh
from tclip.errors import FormatError
from tclip.formats.gguf.header import (
    ARRAY_HEAD,
    MAX_INLINE_STRING,
    GgufArray,
    GgufLongString,
    ValueType,
    parse_gguf,
    read_array,
)

FIXTURES = support.FIXTURES / "gguf"
EXPECTED = json.loads((FIXTURES / "expected.json").read_text())
SHAPE = (4, 256)


def small_spec(order: str = "<") -> gh.GgufSpec:
    rng = np.random.default_rng(0)
    return gh.GgufSpec(
        metadata=[("general.architecture", gh.STRING, "llama"), ("a.n", gh.UINT32, 7),
                  ("a.list", gh.ARRAY, gh.Array(gh.STRING, ["x", "yy", "zzz"]))],
        tensors=[gh.Tensor("w.q", (2, 256), 12, gh.random_blocks(12, 2, rng)),
                 gh.Tensor("w.f", (3, 5), 0, gh.random_blocks(0, 15, rng))],
        order=order)


# ----------------------------------------------------------------------------- fixtures


@pytest.mark.parametrize("name", ["types-le.gguf", "types-be.gguf"])
def test_fixture_metadata_every_value_type(name):
    header = parse_gguf(FIXTURES / name)
    assert header.version == 3
    assert header.byteorder == ("<" if name.endswith("le.gguf") else ">")
    meta, types = header.metadata, header.metadata_types
    assert meta["general.architecture"] == "llama"
    assert meta["general.name"] == "tclip fixture \u00e9"
    assert (meta["test.u8"], meta["test.i8"], meta["test.u16"], meta["test.i16"]) == (200, -100, 60000, -30000)
    assert (meta["test.u32"], meta["test.i32"]) == (4000000000, -2000000000)
    assert (meta["test.u64"], meta["test.i64"]) == (2**63 + 5, -(2**62))
    assert meta["test.f32"] == 0.5 and meta["test.f64"] == 1e-300 and meta["test.bool"] is True
    assert types["test.i16"] == ValueType.INT16 and types["test.f64"] == ValueType.FLOAT64
    nested = meta["test.nested"]
    assert isinstance(nested, GgufArray) and nested.element_type == ValueType.ARRAY and len(nested) == 2
    assert nested.head[0].head == (1, 2, 3) and nested.head[1].head == ("x",)
    tokens = meta["tokenizer.ggml.tokens"]
    assert tokens.length == 1000 and tokens.head == tuple(f"tok{i}" for i in range(ARRAY_HEAD))
    scores = meta["tokenizer.ggml.scores"]
    assert scores.element_type == ValueType.FLOAT32 and scores.head[:3] == (0.0, 0.25, 0.5)
    assert read_array(FIXTURES / name, tokens, header.byteorder)[-1] == "tok999"
    assert read_array(FIXTURES / name, scores, header.byteorder)[999] == 249.75


@pytest.mark.parametrize("name", ["types-le.gguf", "types-be.gguf"])
def test_fixture_tensors(name):
    header = parse_gguf(FIXTURES / name)
    expected = EXPECTED[name]
    assert [t.name for t in header.tensors] == list(
        ["f32", "f16", "bf16", "q8_0", "q4_0", "q4_1", "q5_0", "q5_1", "q2_k", "q3_k", "q4_k", "q5_k",
         "q6_k", "q4_k.spread"])
    assert header.alignment == 32 and header.data_offset % 32 == 0
    assert header.tensor_info_end <= header.data_offset < header.tensor_info_end + 32
    for tensor in header.tensors:
        assert tensor.shape == SHAPE and tensor.dims == SHAPE[::-1]
        assert tensor.ggml_type == expected[tensor.name]["type"]
        assert tensor.offset >= header.data_offset and (tensor.offset - header.data_offset) % 32 == 0
        assert tensor.offset + tensor.nbytes <= header.file_size
    assert header.tensor("q4_k").type_name == "Q4_K" and header.tensor("q4_k").nbytes == 4 * 144
    assert header.split is None


def test_fixture_split_set():
    first = parse_gguf(FIXTURES / "split-00001-of-00002.gguf")
    second = parse_gguf(FIXTURES / "split-00002-of-00002.gguf")
    assert (first.split.no, first.split.count, first.split.tensors_count) == (0, 2, 6)
    assert (second.split.no, second.split.count) == (1, 2)
    assert len(first.tensors) + len(second.tensors) == 6


def test_unknown_types_are_listed_not_fatal():
    header = parse_gguf(FIXTURES / "unknown-types.gguf")
    mystery, iq2, f32 = header.tensors
    assert (mystery.ggml_type, mystery.type_name, mystery.known, mystery.nbytes) == (99, "type 99", False, None)
    assert mystery.shape == (4, 32)
    assert (iq2.type_name, iq2.nbytes) == ("IQ2_XXS", 66)
    assert f32.known and f32.nbytes == 4 * 1024


# ----------------------------------------------------------------------------- written here


@pytest.mark.parametrize("order", ["<", ">"])
def test_own_writer_round_trip(tmp_path, order):
    header = parse_gguf(gh.write_gguf(tmp_path / "m.gguf", small_spec(order)))
    assert header.byteorder == order and header.metadata["a.n"] == 7
    assert header.metadata["a.list"].head == ("x", "yy", "zzz")
    q, f = header.tensors
    assert (q.shape, q.nbytes, f.shape, f.nbytes) == ((2, 256), 288, (3, 5), 60)
    assert f.offset == q.offset + 288  # 288 is a multiple of 32: no padding between


def test_version_2_reads_like_3(tmp_path):
    spec = small_spec()
    spec.version = 2
    assert parse_gguf(gh.write_gguf(tmp_path / "v2.gguf", spec)).version == 2


def test_custom_alignment(tmp_path):
    spec = small_spec()
    spec.alignment = 64
    spec.metadata.append(("general.alignment", gh.UINT32, 64))
    header = parse_gguf(gh.write_gguf(tmp_path / "a.gguf", spec))
    assert header.alignment == 64 and header.data_offset % 64 == 0
    assert header.tensors[1].offset - header.tensors[0].offset == 320  # 288 padded to 64


def test_long_string_is_left_in_the_file(tmp_path):
    text = "x" * (MAX_INLINE_STRING + 1)
    spec = gh.GgufSpec(metadata=[("tokenizer.huggingface.json", gh.STRING, text)])
    value = parse_gguf(gh.write_gguf(tmp_path / "s.gguf", spec)).metadata["tokenizer.huggingface.json"]
    assert isinstance(value, GgufLongString) and value.nbytes == len(text) and value.head == "x" * 200


def test_zero_tensors_and_zero_sized_tensor(tmp_path):
    assert parse_gguf(gh.write_gguf(tmp_path / "e.gguf", gh.GgufSpec())).tensors == ()
    spec = gh.GgufSpec(tensors=[gh.Tensor("empty", (0, 32), 8), gh.Tensor("x", (1, 32), 8, bytes(34))])
    empty, x = parse_gguf(gh.write_gguf(tmp_path / "z.gguf", spec)).tensors
    assert empty.nbytes == 0 and empty.shape == (0, 32) and x.nbytes == 34


def test_undecodable_text_is_kept_visible(tmp_path):
    spec = gh.GgufSpec(metadata=[("k", gh.STRING, b"a\xffb\x1b[31m")])
    assert parse_gguf(gh.write_gguf(tmp_path / "t.gguf", spec)).metadata["k"] == "a\\xffb\x1b[31m"


# ----------------------------------------------------------------------------- hostile headers


def _spec(**changes) -> gh.GgufSpec:
    spec = small_spec()
    for key, value in changes.items():
        setattr(spec, key, value)
    return spec


def _meta(*items) -> gh.GgufSpec:
    return gh.GgufSpec(metadata=list(items))


def _tensors(*tensors) -> gh.GgufSpec:
    return gh.GgufSpec(tensors=list(tensors))


def _raw_tail(tail: bytes, kv_count: int = 1) -> bytes:
    return b"GGUF" + struct.pack("<IQQ", 3, 0, kv_count) + tail


def _deep(levels: int) -> gh.Array:
    inner = gh.Array(gh.UINT8, [1])
    for _ in range(levels):
        inner = gh.Array(gh.ARRAY, [inner])
    return inner


HOSTILE = {
    "bad magic": (gh.gguf_bytes(_spec(magic=b"GGML")), "not a GGUF file"),
    "empty file": (b"", "not a GGUF file"),
    "truncated counts": (b"GGUF" + struct.pack("<I", 3) + bytes(5), "truncated GGUF header"),
    "version 1": (gh.gguf_bytes(_spec(version=1)), "version 1 is not supported"),
    "version 4": (gh.gguf_bytes(_spec(version=4)), "unsupported GGUF version 4"),
    "kv count past EOF": (gh.gguf_bytes(_spec(kv_count=10**6)), "claims 1000000 metadata entries"),
    "kv count 2**64-1": (gh.gguf_bytes(_spec(kv_count=2**64 - 1)), "metadata entries"),
    "tensor count past EOF": (gh.gguf_bytes(_spec(tensor_count=10**9)), "claims 1000000000 tensors"),
    "key length past EOF": (_raw_tail(struct.pack("<Q", 2**63) + bytes(20)), "more than 65535"),
    "key past EOF": (_raw_tail(struct.pack("<Q", 60) + bytes(20)), "claims 60 bytes, past the end"),
    "string value past EOF": (_raw_tail(gh.string("k") + struct.pack("<IQ", gh.STRING, 10**12)),
                              "claims 1000000000000 bytes"),
    "array length past EOF": (_raw_tail(gh.string("k") + struct.pack("<IIQ", gh.ARRAY, gh.UINT64, 2**60)),
                              "claims 1152921504606846976 elements"),
    "string array past EOF": (_raw_tail(gh.string("k") + struct.pack("<IIQ", gh.ARRAY, gh.STRING, 3)
                                        + gh.string("a") + struct.pack("<Q", 2**40) + bytes(20)),
                              "past the end of the file"),
    "unknown value type": (_raw_tail(gh.string("k") + struct.pack("<I", 13) + bytes(16)),
                           "is 13, not a GGUF value type"),
    "unknown array element type": (_raw_tail(gh.string("k") + struct.pack("<IIQ", gh.ARRAY, 77, 1) + bytes(8)),
                                   "is 77, not a GGUF value type"),
    "bool of 2": (_raw_tail(gh.string("k") + struct.pack("<IB", gh.BOOL, 2)), "bool of value 2"),
    "bool array of 5": (gh.gguf_bytes(_meta(("k", gh.ARRAY, gh.Array(gh.UINT8, [0] * 20)))).replace(
        struct.pack("<IQ", gh.UINT8, 20), struct.pack("<IQ", gh.BOOL, 20)).replace(bytes(20), bytes(19) + b"\5"),
        "neither 0 nor 1"),
    "nested too deep": (gh.gguf_bytes(_meta(("k", gh.ARRAY, _deep(20)))), "nested deeper than 16"),
    "duplicate key": (gh.gguf_bytes(_meta(("k", gh.UINT8, 1), ("k", gh.UINT8, 2))), "'k' appears twice"),
    "alignment not a power of two": (gh.gguf_bytes(_meta(("general.alignment", gh.UINT32, 48))),
                                     "48 is not a power of two"),
    "alignment zero": (gh.gguf_bytes(_meta(("general.alignment", gh.UINT32, 0))), "0 is not a power of two"),
    "alignment of another type": (gh.gguf_bytes(_meta(("general.alignment", gh.UINT64, 32))),
                                  "must be a UINT32, got UINT64"),
    "absurd n_dims": (gh.gguf_bytes(_tensors(gh.Tensor("t", (1,), 0, bytes(4), n_dims=2**31))),
                      "'t' claims 2147483648 dimensions"),
    "nine dims": (gh.gguf_bytes(_tensors(gh.Tensor("t", (1,) * 9, 0, bytes(4)))), "claims 9 dimensions"),
    "negative dim": (gh.gguf_bytes(_tensors(gh.Tensor("t", (1,), 0, bytes(4), dims=(2**64 - 1,)))),
                     "negative dimension"),
    "dims overflow": (gh.gguf_bytes(_tensors(gh.Tensor("t", (1,), 0, bytes(4), dims=(2**32, 2**32)))),
                      "more than 2**63 - 1"),
    "row not whole blocks": (gh.gguf_bytes(_tensors(gh.Tensor("t", (2, 100), 12, bytes(288)))),
                             "rows of 100 values are not a whole number of Q4_K blocks"),
    "unaligned offset": (gh.gguf_bytes(_tensors(gh.Tensor("t", (4,), 0, bytes(16), offset=8))),
                         "data offset 8 is not a multiple of the alignment 32"),
    "data past EOF": (gh.gguf_bytes(_tensors(gh.Tensor("w.q", (2, 256), 12, bytes(288))))[:-1],
                      "tensor 'w.q': its data (bytes"),
    "offset past EOF": (gh.gguf_bytes(_tensors(gh.Tensor("far", (4,), 0, bytes(16)),
                                               gh.Tensor("t", (1,), 0, b"", offset=2**62))),
                        "tensor 't'"),
    "unknown type past EOF": (gh.gguf_bytes(_tensors(gh.Tensor("u", (4,), 99, b"", offset=2**40))),
                              "tensor 'u': its data (byte"),
    "overlapping data": (gh.gguf_bytes(_tensors(gh.Tensor("a", (16,), 0, bytes(64), offset=0),
                                                gh.Tensor("b", (16,), 0, bytes(64), offset=32))),
                         "tensors 'a' and 'b' overlap"),
    "unknown type inside another": (gh.gguf_bytes(_tensors(gh.Tensor("a", (16,), 0, bytes(64), offset=0),
                                                           gh.Tensor("u", (1,), 99, b"", offset=32))),
                                    "tensors 'a' and 'u' overlap"),
    "duplicate tensor": (gh.gguf_bytes(_tensors(gh.Tensor("a", (8,), 0, bytes(32)),
                                                gh.Tensor("a", (8,), 0, bytes(32)))),
                         "tensor name 'a' appears twice"),
    "name too long": (gh.gguf_bytes(_tensors(gh.Tensor("n" * 70000, (1,), 0, bytes(4)))), "more than 65535"),
}


@pytest.mark.parametrize("case", list(HOSTILE))
def test_hostile_header_is_one_clean_error(tmp_path, case):
    data, message = HOSTILE[case]
    path = tmp_path / "bad.gguf"
    path.write_bytes(data)
    with pytest.raises(FormatError) as caught:
        parse_gguf(path)
    assert message in str(caught.value)
    assert str(caught.value).startswith(f"{path}: ")
    assert path.read_bytes() == data  # input untouched


def test_every_truncation_is_one_clean_error(tmp_path):
    """Cut a valid file at every byte: a FormatError each time (the last cut names the tensor)."""
    data = gh.gguf_bytes(small_spec())
    path = tmp_path / "cut.gguf"
    for length in range(len(data)):
        path.write_bytes(data[:length])
        with pytest.raises(FormatError):
            parse_gguf(path)
    path.write_bytes(data[:-1])
    with pytest.raises(FormatError, match="tensor 'w.f'"):
        parse_gguf(path)


def test_big_endian_version_detected_and_swapped_counts_checked(tmp_path):
    data = bytearray(gh.gguf_bytes(small_spec(">")))
    assert parse_gguf(gh.write_gguf(tmp_path / "ok.gguf", small_spec(">"))).byteorder == ">"
    data[8:16] = struct.pack("<Q", 1)  # a little-endian tensor count in a big-endian file: huge
    path = tmp_path / "mixed.gguf"
    path.write_bytes(bytes(data))
    with pytest.raises(FormatError, match="tensors"):
        parse_gguf(path)


def test_huge_claims_cost_no_time_or_memory(tmp_path):
    """Counts near 2**64 are refused before any loop or allocation."""
    path = tmp_path / "huge.gguf"
    for data in (_raw_tail(gh.string("k") + struct.pack("<IIQ", gh.ARRAY, gh.ARRAY, 2**64 - 1)),
                 gh.gguf_bytes(_spec(kv_count=2**64 - 1, tensor_count=2**64 - 1))):
        path.write_bytes(data)
        start = time.perf_counter()
        with pytest.raises(FormatError):
            parse_gguf(path)
        assert time.perf_counter() - start < 1.0  # a loop over the claim would take forever


@given(st.data())
def test_mutated_headers_parse_or_fail_cleanly(tmp_path_factory, data):
    """Any byte of a valid header changed: either a header or a FormatError, nothing else."""
    original = gh.gguf_bytes(small_spec())
    header_end = 400  # the infos end before the data at 416
    mutated = bytearray(original)
    for _ in range(data.draw(st.integers(1, 4))):
        mutated[data.draw(st.integers(0, header_end))] = data.draw(st.integers(0, 255))
    path = tmp_path_factory.mktemp("fuzz") / "m.gguf"
    path.write_bytes(bytes(mutated))
    try:
        header = parse_gguf(path)
    except FormatError:
        return
    for tensor in header.tensors:
        assert tensor.offset + (tensor.nbytes or 0) <= len(mutated)


# ----------------------------------------------------------------------------- the gguf package


@pytest.mark.parametrize("endian", ["LITTLE", "BIG"])
def test_files_of_the_gguf_package(tmp_path, endian):
    gguf = pytest.importorskip("gguf")
    path = tmp_path / "p.gguf"
    writer = gguf.GGUFWriter(str(path), "llama", endianess=gguf.GGUFEndian[endian])
    writer.add_uint32("llama.block_count", 2)
    writer.add_float32("llama.rope.freq_base", 10000.0)
    writer.add_bool("t.flag", False)
    writer.add_string("t.text", "h\u00e9")
    writer.add_array("t.ints", [1, -2, 3])
    writer.add_array("t.strings", ["a", "bc"])
    writer.add_uint64("t.u64", 2**40)
    writer.add_tensor("f32", np.arange(12, dtype=np.float32).reshape(3, 4))
    writer.add_tensor("f16", np.ones((2, 8, 64), dtype=np.float16))
    quantized = gguf.quants.quantize(np.ones((4, 64), np.float32), gguf.GGMLQuantizationType.Q8_0)
    writer.add_tensor("q8", quantized, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    header = parse_gguf(path)
    reader = gguf.GGUFReader(str(path))
    assert header.byteorder == ("<" if endian == "LITTLE" else ">")
    assert header.metadata["llama.block_count"] == 2 and header.metadata["t.text"] == "h\u00e9"
    assert header.metadata["llama.rope.freq_base"] == 10000.0 and header.metadata["t.flag"] is False
    assert header.metadata["t.ints"].head == (1, -2, 3) and header.metadata["t.strings"].head == ("a", "bc")
    assert header.metadata["t.u64"] == 2**40
    assert list(header.metadata) == [key for key in reader.fields if not key.startswith("GGUF.")]
    for ours, theirs in zip(header.tensors, reader.tensors):
        assert ours.name == theirs.name
        assert ours.dims == tuple(int(n) for n in theirs.shape)
        assert ours.ggml_type == int(theirs.tensor_type)
        assert (ours.offset, ours.nbytes) == (theirs.data_offset, theirs.n_bytes)
    assert header.tensor("f16").shape == (2, 8, 64)


def test_data_offsets_agree_with_the_gguf_reader_on_fixtures():
    gguf = pytest.importorskip("gguf")
    for name in ("types-le.gguf", "split-00001-of-00002.gguf", "nan-scales.gguf"):
        header = parse_gguf(FIXTURES / name)
        reader = gguf.GGUFReader(str(FIXTURES / name))
        assert [(t.name, t.offset, t.nbytes) for t in header.tensors] == [
            (t.name, t.data_offset, t.n_bytes) for t in reader.tensors]
        assert list(header.metadata) == [key for key in reader.fields if not key.startswith("GGUF.")]
