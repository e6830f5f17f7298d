"""The small records of a torch.save zip (``byteorder``, ``version``), read with one ``pread`` and
their CRC-32 checked by tclip (a DCP folder's thousands of chunk zips each have two): a record
whose CRC does not match is refused in zipfile's words, as when zipfile read every record."""

from __future__ import annotations

import zlib
from pathlib import Path

from formats.pytorch.test_torch_archive import error_of, one_tensor_file, tensor
from tclip.formats.torch.archive import load_torch_archive


def test_records_read_directly(tmp_path: Path) -> None:
    archive = load_torch_archive(one_tensor_file(tmp_path, tensor(), byteorder=b"big"))
    assert (archive.byteorder, archive.version) == ("big", "3")


def test_a_record_failing_its_crc_is_refused(tmp_path: Path) -> None:
    bad = zlib.crc32(b"little") ^ 1
    path = one_tensor_file(tmp_path, tensor(), overrides={1: {"crc": bad}})  # member 1: archive/byteorder
    message = error_of(path)
    assert "member 'archive/byteorder'" in message and "Bad CRC-32" in message, message
