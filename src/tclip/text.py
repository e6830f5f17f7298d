"""Text from files, for people: escaped, compared and sorted without any terminal library."""

from __future__ import annotations

import json
import math
import re
from collections.abc import Sequence
from typing import Any


def safe(text: object) -> str:
    """``text`` with every non-printable character escaped (``\\x1b``, ``\\n``, lone surrogates...)."""
    value = str(text)
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


def show_value(value: Any) -> str:
    """A metadata or attribute value as text: strings literally, the rest as JSON."""
    if isinstance(value, str):
        return safe(value)
    try:
        return safe(json.dumps(value, ensure_ascii=False, default=str))
    except (TypeError, ValueError):
        return safe(repr(value))


_NUMBER_PARTS = re.compile(r"(\d+)")


def natural_key(name: str) -> list[Any]:
    """Sort key that puts ``layers.2`` before ``layers.10``."""
    return [(0, int(part)) if part.isdigit() else (1, part) for part in _NUMBER_PARTS.split(name)]


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
    plain = all(_special(v, dash) is not None or 1e-3 <= abs(v) < 1e5 for v in values)  # type: ignore[arg-type]
    out = []
    for v in values:
        special = _special(v, dash)
        if special is not None:
            out.append(special)
        else:
            out.append(f"{v:.4g}" if plain else f"{v:.3e}")
    return out
