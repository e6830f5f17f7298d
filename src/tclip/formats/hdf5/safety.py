"""What an untrusted HDF5 file may not make tclip do: data in other files, decompression bombs,
filters that are missing or lossy, output names that climb out of the file's tree.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from ...errors import UnsupportedError

if TYPE_CHECKING:
    import h5py


_H5PY: Any = None


def import_h5py() -> Any:
    """h5py, imported on first use with hdf5plugin's filters (blosc, blosc2, bzip2, lz4,
    zstd...) registered where installed: the format registry imports this module, and a
    run that never meets an HDF5 file never pays for h5py."""
    global _H5PY
    if _H5PY is None:
        import h5py

        try:
            import hdf5plugin  # noqa: F401
        except ImportError:  # the optional extra tclip[hdf5-filters]
            pass
        _H5PY = h5py
    return _H5PY


_H5_ERRORS = (OSError, ValueError, RuntimeError, KeyError, TypeError, AttributeError, IndexError, OverflowError,
              SystemError)


# A dataset may hold at most this much more data than the file stores for it
# (compression of a constant, or chunks never written, read as the fill value).
BOMB_FLOOR_BYTES = 4 << 30


BOMB_RATIO = 4096


# Rewriting a dataset of more chunks than this is refused (HDF5 spends microseconds per chunk).
MAX_REWRITTEN_CHUNKS = 1 << 22


def foreign_storage(dataset: h5py.Dataset) -> str | None:
    """Why a dataset's data is not in this file (external storage, virtual), or None.

    Such data lives in other files, named by the file itself: reading it would
    read any file the author chose, writing it would write there. tclip does
    neither (see README, Security).
    """
    if dataset.is_virtual:
        sources = sorted({str(m.file_name) for m in dataset.virtual_sources()})
        shown = ", ".join(repr(s) for s in sources[:3]) + (" ..." if len(sources) > 3 else "")
        return f"virtual dataset: its data lives in other files ({shown}), which tclip never reads or writes"
    external = dataset.external
    if external:
        names = sorted({e[0].decode("utf-8", "replace") if isinstance(e[0], bytes) else str(e[0]) for e in external})
        shown = ", ".join(repr(n) for n in names[:3]) + (" ..." if len(names) > 3 else "")
        return f"external storage: its data lives in other files ({shown}), which tclip never reads or writes"
    return None


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return (text.splitlines()[0] if text else type(error).__name__)[:300]


# HDF5 filter ids of the registered filters h5py does not ship, and the package
# that provides them (https://github.com/HDFGroup/hdf5_plugins/blob/master/docs/RegisteredFilterPlugins.md).
_PLUGIN_FILTERS = {
    307: "bzip2", 32001: "blosc", 32004: "lz4", 32008: "bitshuffle", 32015: "zstd", 32026: "blosc2",
    32013: "zfp", 32017: "sz", 32024: "sz3", 32018: "fcidecomp",
}


def _filter_message(error: BaseException) -> str:
    text = _first_line(error)
    if "filter" in text.lower() or "can't open directory" in text.lower():
        return (f"{text}; it is compressed with an HDF5 filter this installation lacks: "
                "pip install 'tclip[hdf5-filters]' (hdf5plugin) provides blosc, blosc2, bzip2, lz4, zstd and more")
    return f"{text}; the file may be truncated or corrupt"


def missing_filters(dataset: h5py.Dataset) -> list[str]:
    """Names of the filters of a dataset that HDF5 cannot apply here."""
    h5py = import_h5py()
    missing = []
    plist = dataset.id.get_create_plist()
    for i in range(plist.get_nfilters()):
        filter_id = plist.get_filter(i)[0]
        if not h5py.h5z.filter_avail(filter_id):
            missing.append(_PLUGIN_FILTERS.get(filter_id, f"filter {filter_id}"))
    return missing


def _unreadable_filters(dataset: h5py.Dataset) -> str | None:
    missing = missing_filters(dataset)
    if not missing:
        return None
    return (f"compressed with {', '.join(missing)}, which this installation of HDF5 cannot read: "
            "pip install 'tclip[hdf5-filters]' (the hdf5plugin package)")


# Registered HDF5 filters that do not give back the bytes they were given.
_LOSSY_PLUGINS = {32013: "ZFP", 32017: "SZ", 32024: "SZ3", 32019: "JPEG", 32028: "SPERR"}


def lossy_filter(dataset: h5py.Dataset) -> str | None:
    """The lossy filter a float dataset's chunks pass (None: they come back as written).

    HDF5's scale-offset filter keeps a float to the decimal digits its scale factor
    says (``scaleoffset=3``: three), so a value written is not the value read back;
    on integers (with the minimum bits computed) it is lossless.
    """
    h5py = import_h5py()
    plist = dataset.id.get_create_plist()
    for i in range(plist.get_nfilters()):
        code, _, values, _ = plist.get_filter(i)
        if code == h5py.h5z.FILTER_SCALEOFFSET and dataset.dtype.kind in "fc":
            digits = f", {values[1]} decimal digits" if len(values) > 1 else ""
            return f"HDF5's scale-offset filter{digits}"
        if code in _LOSSY_PLUGINS:
            return f"the {_LOSSY_PLUGINS[code]} filter"
    return None


def _check_path(name: str, target: Path) -> None:
    parts = name.split("/")
    if not name or any(p in ("", ".", "..") for p in parts):
        raise UnsupportedError(f"tensor name {name!r} is not a valid HDF5 path", target)


def _check_tree(names: list[str], target: Path) -> None:
    """Refuse names that need one path to be a dataset and a group at once (``a`` and ``a/b``)."""
    datasets = set(names)
    for name in names:
        parts = name.split("/")
        for depth in range(1, len(parts)):
            group = "/".join(parts[:depth])
            if group in datasets:
                raise UnsupportedError(f"tensors {group!r} and {name!r} cannot both be written to HDF5: "
                                       f"{group!r} would have to be a dataset and the group holding {name!r}; "
                                       "rename one, or write .safetensors or .npz", target)
