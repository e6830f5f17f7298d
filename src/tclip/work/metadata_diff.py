"""``diff``: what two files say besides their tensors -- file metadata (safetensors
``__metadata__``, HDF5 root attributes, an index's ``metadata``), the attributes of HDF5
groups and datasets -- compared key by key, as ``h5diff`` does.

Values are compared as the plain data the readers give (an attribute ``1`` is not
``1.0`` nor ``"1"``). Across two formats only the file metadata is compared, as the
strings a conversion carries (safetensors holds strings only); a format that holds
no metadata (.npy, .npz) has none to compare. Two sharded sets compare their
indexes' metadata (not ``total_size`` nor ``total_parameters``, derived from the tensors);
their shards' own metadata is not compared.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

from ..formats import TensorReader
from ..formats.registry import holds_metadata
from ..formats.sharded import SetReader
from ..text import natural_key, show_value

# How many characters of each value a difference shows (around where the two first differ).
SHOWN = 60
_CONTEXT = 20


@dataclass(frozen=True)
class MetadataDifference:
    """One key whose value differs: ``where`` is None for the file's own metadata, else the
    group or tensor (A's name) that holds the attribute; ``a``/``b`` the values as text,
    shortened around their first difference (None: the key is not there)."""

    where: str | None
    key: str
    a: str | None
    b: str | None


def shorten_pair(a: str, b: str, width: int = SHOWN) -> tuple[str, str]:
    """Both texts cut to ``width`` characters at the same place, around where they first
    differ (two 40 KiB model configs differing deep inside show the difference)."""
    if len(a) <= width and len(b) <= width:
        return a, b
    common = 0
    for x, y in zip(a, b):
        if x != y:
            break
        common += 1
    start = 0 if common < width - _CONTEXT else common - _CONTEXT

    def cut(text: str) -> str:
        piece = text[start:start + width]
        return ("…" if start else "") + piece + ("…" if start + width < len(text) else "")

    return cut(a), cut(b)


def _canonical(value: Any) -> str:
    return json.dumps(value, sort_keys=True, ensure_ascii=False, default=str)


def _portable(value: Any) -> str:
    # What a conversion writes into a format of string metadata (formats.registry).
    return value if isinstance(value, str) else json.dumps(value, default=str)


def compare_mappings(where: str | None, a: dict[str, Any], b: dict[str, Any],
                     portable: bool = False) -> Iterator[MetadataDifference]:
    """The keys of two metadata mappings whose values differ, in A's order, then B's own keys."""
    form = _portable if portable else _canonical
    for key, value in a.items():
        if key not in b:
            yield MetadataDifference(where, str(key), show_value(value, None), None)
        elif form(value) != form(b[key]):
            shown_a, shown_b = show_value(value, None), show_value(b[key], None)  # (whole: shortened below)
            if shown_a == shown_b:  # "1" against 1: show them as JSON, where they differ
                shown_a, shown_b = _canonical(value), _canonical(b[key])
            shown_a, shown_b = shorten_pair(shown_a, shown_b)
            yield MetadataDifference(where, str(key), shown_a, shown_b)
    for key, value in b.items():
        if key not in a:
            yield MetadataDifference(where, str(key), None, show_value(value, None))


def _shortened(difference: MetadataDifference) -> MetadataDifference:
    a, b = difference.a, difference.b
    if a is not None and b is not None:
        return difference
    text = a if a is not None else b
    if text is None or len(text) <= SHOWN:
        return difference
    cut = text[:SHOWN] + "…"
    return MetadataDifference(difference.where, difference.key, cut if a is not None else None,
                              cut if b is not None else None)


def _format_holds_metadata(reader: TensorReader) -> bool:
    try:
        return holds_metadata(reader.format_name)
    except KeyError:  # a set of no files
        return False


# An index's keys that its writer derives from the tensors (bytes, parameter count): a dtype
# change alters the one, an older writer leaves out the other; the tensors themselves are compared.
DERIVED_INDEX_KEYS = frozenset({"total_size", "total_parameters"})


# What a DCP folder's reader says of how it was saved, not of what it holds (the storage, the
# metadata's version, how many ranks wrote the pieces): the same tensors saved on 2 ranks or 8, as
# one .metadata or as Hugging Face pieces, are the same checkpoint. Megatron's keys are compared.
LAYOUT_KEYS = frozenset({"ranks", "dcp_storage", "dcp_version"})


def _unlaid(reader: TensorReader) -> dict[str, Any]:
    return {k: v for k, v in reader.metadata.items() if k not in LAYOUT_KEYS}


def _index_metadata(reader: TensorReader) -> dict[str, Any]:
    return {k: v for k, v in reader.metadata.items() if k not in DERIVED_INDEX_KEYS}


def metadata_differences(reader_a: TensorReader, reader_b: TensorReader, pairs: Iterable[tuple[str, str]],
                         whole_files: bool) -> tuple[list[MetadataDifference], bool]:
    """Every difference in what the two files say besides their tensors, and whether the file
    metadata could be compared at all (False: a format holds none, but one side has some).

    ``pairs``: (A's name, B's name) of the tensors found on both sides, whose attributes are
    compared; ``whole_files``: also the file metadata and the groups' attributes (False when
    a selection narrowed the comparison to some tensors).
    """
    found: list[MetadataDifference] = []
    compared = True
    same_format = reader_a.format_name == reader_b.format_name
    sets = isinstance(reader_a, SetReader), isinstance(reader_b, SetReader)
    if whole_files and any(sets):
        # An index's metadata is the set's bookkeeping, not a file's: compared between two
        # sets only, without the keys derived from the tensors (DERIVED_INDEX_KEYS).
        if all(sets):
            found += compare_mappings(None, _index_metadata(reader_a), _index_metadata(reader_b))
    elif whole_files:
        if _format_holds_metadata(reader_a) and _format_holds_metadata(reader_b):
            found += compare_mappings(None, dict(reader_a.metadata), dict(reader_b.metadata), not same_format)
        elif same_format:
            # What such a format's readers find beside the tensors (a DCP folder's dcp_version,
            # Megatron's metadata.json) is comparable between two of its files, but for the layout.
            found += compare_mappings(None, _unlaid(reader_a), _unlaid(reader_b))
        elif reader_a.metadata or reader_b.metadata:
            compared = False
        if same_format:
            groups_a, groups_b = reader_a.group_attributes, reader_b.group_attributes
            for group in sorted(set(groups_a) | set(groups_b), key=natural_key):
                found += compare_mappings(group, groups_a.get(group, {}), groups_b.get(group, {}))
    if same_format:
        for name_a, name_b in pairs:
            attrs_a, attrs_b = reader_a.tensors[name_a].attrs, reader_b.tensors[name_b].attrs
            if attrs_a or attrs_b:
                found += compare_mappings(name_a, dict(attrs_a), dict(attrs_b))
    return [_shortened(d) for d in found], compared
