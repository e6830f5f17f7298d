"""Text from files, for people: escaped, compared and sorted without any terminal library."""

from __future__ import annotations

import json
import math
import re
from collections.abc import Sequence
from typing import Any


# Text from files (a name, a metadata value) longer than this is shown shortened to this many
# characters, its length in the middle: a name of 50 million characters is data, and laying it
# out in a table took rich 25 s. JSON keeps every text whole.
LONG_TEXT = 1000


def bounded(text: str, limit: int = LONG_TEXT) -> str:
    """``text``, or where it is longer than ``limit`` its start and end around ``…(N chars)…``,
    ``limit`` characters in all (so bounding twice changes nothing)."""
    if len(text) <= limit:
        return text
    marker = f"…({len(text):,} chars)…"
    keep = max(0, limit - len(marker))
    head = keep * 3 // 4
    return text[:head] + marker + text[len(text) - (keep - head):]


def safe(text: object, limit: int | None = LONG_TEXT) -> str:
    """``text`` with every non-printable character escaped (``\\x1b``, ``\\n``, lone surrogates...),
    shortened past ``limit`` characters (:func:`bounded`; None: whole, for data that is shortened
    where it matters, such as two values around their first difference)."""
    value = str(text) if limit is None else bounded(str(text), limit)
    if value.isprintable():
        return value
    out = []
    for c in value:
        if c.isprintable():
            out.append(c)
        else:
            code = ord(c)
            out.append(f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}" if code < 0x10000 else f"\\U{code:08x}")
    return "".join(out)


def show_value(value: Any, limit: int | None = LONG_TEXT) -> str:
    """A metadata or attribute value as text: strings literally, the rest as JSON (``limit``:
    as :func:`safe`'s)."""
    if isinstance(value, str):
        return safe(value, limit)
    try:
        return safe(json.dumps(value, ensure_ascii=False, default=str), limit)
    except (TypeError, ValueError):
        return safe(repr(value), limit)


# ASCII digits only: ``\d`` and ``str.isdigit`` also accept ``²`` and other Unicode digits,
# which ``int()`` refuses or reads as other numbers.
_NUMBER_PARTS = re.compile(r"([0-9]+)")


def natural_key(name: str) -> list[Any]:
    """Sort key that puts ``layers.2`` before ``layers.10``.

    Runs of ASCII digits compare as numbers -- by their length without leading zeros,
    then digit by digit, so a name holding a number of thousands of digits costs no
    ``int()`` (which refuses more than 4,300 digits) -- and equal numbers by their
    text (``07`` before ``7``); everything else (``²``, other scripts' digits) is text.
    """
    parts = _NUMBER_PARTS.split(name)
    key: list[Any] = []
    for i, part in enumerate(parts):
        if i % 2:  # split() puts the digit runs at the odd places, so places never mix kinds
            digits = part.lstrip("0")
            key.append((len(digits), digits, part))
        else:
            key.append(part)
    return key


def shown_key(name: str) -> list[Any]:
    """:func:`natural_key` of ``name`` as people see it (:func:`bounded`): the order of a table's
    rows, which never scans the millions of characters a shortened name hides."""
    return natural_key(bounded(name))


def name_list(names: Sequence[str], limit: int = 3, *, total: int | None = None) -> str:
    """``a, b, c and 47 more``: at most ``limit`` names (in the order given), so a line
    naming tensors stays one line whatever their number; ``total`` when ``names`` holds
    only the first few of them."""
    count = len(names) if total is None else total
    shown = ", ".join(names[:limit])
    return shown if count <= limit else f"{shown} and {count - min(limit, len(names))} more"


def _special(value: float | None, dash: str) -> str | None:
    if value is None:
        return dash
    if math.isnan(value):
        return "nan"
    if math.isinf(value):
        return "inf" if value > 0 else "-inf"
    if value == 0:
        return "0"
    return None


def fmt_number(value: float | None, dash: str = "—") -> str:
    special = _special(value, dash)
    if special is not None:
        return special
    assert value is not None
    if 1e-3 <= abs(value) < 1e5:
        return f"{value:.4g}"
    return f"{value:.3e}"


def fmt_column(values: Sequence[float | None], dash: str = "—") -> list[str]:
    """One number format for a whole column: plain when every value fits it, else scientific."""
    plain = all(_special(v, dash) is not None or (v is not None and 1e-3 <= abs(v) < 1e5) for v in values)
    out = []
    for v in values:
        special = _special(v, dash)
        if special is not None:
            out.append(special)
        else:
            out.append(f"{v:.4g}" if plain else f"{v:.3e}")
    return out
