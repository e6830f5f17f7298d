"""HDF5 values as plain Python values: datasets classified as tensors or not, attributes read within limits.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import numpy as np

from .probe import beat
from .safety import _H5_ERRORS, import_h5py

if TYPE_CHECKING:
    import h5py


# Attributes larger than this are described, not read (a crafted attribute can
# claim a dataspace of 2**60 elements).
ATTRIBUTE_LIMIT_BYTES = 1 << 20


# The kind of a dataset of a type tclip cannot read (times, bitfields, opaque data, quad
# floats...): it may hold numbers, so no check passes over it (OtherObject.unreadable_type).
UNSUPPORTED = "unsupported type"


def classify(dataset: h5py.Dataset) -> tuple[str, str, bool] | None:
    """(kind, reason, numeric) for a dataset that is not a tensor tclip reads; None for a tensor."""
    h5py = import_h5py()
    try:
        dtype = dataset.dtype
    except _H5_ERRORS:
        type_class = dataset.id.get_type().get_class()
        names = {h5py.h5t.TIME: "an HDF5 time type", h5py.h5t.BITFIELD: "a bitfield type",
                 h5py.h5t.OPAQUE: "an opaque type"}
        return UNSUPPORTED, f"{names.get(type_class, 'a type NumPy cannot hold')} is not supported", False
    if dataset.shape is None:
        return "empty dataset", "holds no data (null dataspace)", False
    if h5py.h5ds.is_scale(dataset.id):
        return "dimension scale", "coordinates of another dataset's axis, not a tensor", dtype.kind in "biuf"
    if h5py.check_enum_dtype(dtype) is not None:
        return "enum dataset", "enumerated values, not numbers", False
    if h5py.check_ref_dtype(dtype) is not None:
        return "reference dataset", "object or region references, not numbers", False
    if h5py.check_vlen_dtype(dtype) is not None or h5py.check_string_dtype(dtype) is not None \
            or dtype.kind in "SUO":
        return "string dataset", "strings, not numbers", False
    if dtype.fields is not None:
        return "compound dataset", "compound records, not numbers", False
    if dtype.kind not in "biufc":
        return UNSUPPORTED, f"{dtype} is not a numeric type", False
    if dtype.kind in "fc" and dtype.itemsize > (16 if dtype.kind == "c" else 8):
        return UNSUPPORTED, f"{dtype.itemsize * 8}-bit floats (quad precision) are not supported", False
    if dtype.kind == "f" and dataset.id.get_type().get_size() != dtype.itemsize:
        return UNSUPPORTED, "a non-standard floating-point layout is not supported", False
    return None


def plain_value(value: Any, file: h5py.File | None = None) -> Any:
    """An attribute value as plain data for reports and JSON: str, int, float, bool,
    None, lists and dicts. Byte strings are decoded (UTF-8, else Latin-1),
    references become the path they point to, empty attributes None."""
    h5py = import_h5py()
    if isinstance(value, h5py.Empty):
        return None
    if isinstance(value, (bytes, np.bytes_)):
        raw = bytes(value)
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            return raw.decode("latin-1")
    if isinstance(value, h5py.RegionReference):
        return f"<region reference to {_deref(value, file)}>"
    if isinstance(value, h5py.Reference):
        return f"<reference to {_deref(value, file)}>"
    if isinstance(value, np.void):
        if value.dtype.fields:
            return {key: plain_value(value[key], file) for key in value.dtype.names}
        return bytes(value).hex()
    if isinstance(value, np.ndarray):
        if value.dtype.fields:
            return [plain_value(v, file) for v in value.reshape(-1)]
        if value.dtype.kind in "OSUV":
            return _nested([plain_value(v, file) for v in value.reshape(-1)], value.shape)
        if value.dtype.kind == "c":
            return _nested([str(v) for v in value.reshape(-1).tolist()], value.shape)
        return value.tolist()
    if isinstance(value, np.generic):
        item = value.item()
        return str(item) if isinstance(item, complex) else item
    if isinstance(value, complex):
        return str(value)
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    return str(value)


def _nested(flat: list[Any], shape: tuple[int, ...]) -> Any:
    if not shape:
        return flat[0] if flat else None
    if len(shape) == 1:
        return flat
    step = math.prod(shape[1:])
    return [_nested(flat[i * step:(i + 1) * step], shape[1:]) for i in range(shape[0])]


def _deref(reference: Any, file: h5py.File | None) -> str:
    h5py = import_h5py()
    if not reference or file is None:
        return "nothing"
    try:
        return str(h5py.h5r.get_name(reference, file.id).decode("utf-8", "replace"))
    except _H5_ERRORS:
        return "an unreadable object"


def attributes(obj: h5py.HLObject) -> dict[str, Any]:
    """An object's attributes as plain values (for reports), in the file's order."""
    out: dict[str, Any] = {}
    try:
        names = list(obj.attrs)
    except _H5_ERRORS:
        return {"<attributes>": "<unreadable>"}
    for key in names:
        beat()
        out[key] = _attribute(obj, key)
    return out


def _attribute(obj: h5py.HLObject, key: str) -> Any:
    h5py = import_h5py()
    try:
        attr = h5py.h5a.open(obj.id, key.encode("utf-8"))
        shape, dtype = attr.shape, attr.dtype
        if shape is not None and math.prod(shape) * max(dtype.itemsize, 1) > ATTRIBUTE_LIMIT_BYTES:
            return f"<{'x'.join(map(str, shape))} attribute of {dtype}, not shown>"
        return plain_value(obj.attrs[key], obj.file)
    except _H5_ERRORS:
        return "<unreadable>"


def _standard_type(dataset: h5py.Dataset) -> bool:
    """The stored type is the IEEE/two's complement layout of the dataset's NumPy dtype."""
    h5py = import_h5py()
    try:
        return bool(dataset.id.get_type().equal(h5py.h5t.py_create(dataset.dtype)))
    except _H5_ERRORS:
        return False
