"""Messages that name options, and texts that carry their kind: the library's words, typed.

A :data:`Message` is a string, or a tuple of strings and :class:`Option` members.
The library names an option by its parameter (``nonfinite='propagate'``), the
command line by its flag (``--nonfinite propagate``, see :mod:`tclip.cli.words`):
so a library error never speaks of flags, and the command line's lines read as
they always did.

:class:`Tagged` is a text (a ``str``, for people and for JSON) that also carries
its ``kind`` (an enum member, for code). Skip reasons, report warnings and diff
notes are tagged: every decision reads the kind, never the words, so rewording a
message never changes what tclip does or its exit status.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from typing import Any, Union


class Option(enum.Enum):
    """An option a message asks the user to change; the value is the library's name for it."""

    FORCE = "overwrite=True"
    EXCLUDE = "an exclude pattern"
    INCLUDE = "an include pattern"
    PROPAGATE = "nonfinite='propagate'"
    DROP_NONNUMERIC = "drop_nonnumeric=True"
    MEMORY = "the memory budget"
    IN_PLACE = "in_place=True"
    OUT_DIR = "out_dir"
    AXES = "axes"
    MAP = "the mapping"
    DASK = "dask_address"
    TENSORS_ONLY = "tensors_only=True"


Message = Union[str, tuple[Union[str, Option], ...]]
Naming = Callable[[Option], str]


def library_name(option: Option) -> str:
    """How the library names an option in its messages."""
    return option.value


def spell(message: Message, name: Naming = library_name) -> str:
    """The text of ``message`` with every option named by ``name``."""
    if isinstance(message, str):
        return message
    return "".join(part if isinstance(part, str) else name(part) for part in message)


class Tagged(str):
    """A text for people (its ``str`` value, with options in the library's words) that carries
    its ``kind`` for code, and its :data:`Message` to be spelled with other words."""

    kind: enum.Enum
    message: Message

    def __new__(cls, kind: enum.Enum, message: Message) -> "Tagged":
        tagged = super().__new__(cls, spell(message))
        tagged.kind = kind
        tagged.message = message
        return tagged

    def spelled(self, name: Naming = library_name) -> str:
        return spell(self.message, name)

    def __reduce__(self) -> tuple[Any, ...]:  # pickled across processes with the set's statistics
        return type(self), (self.kind, self.message)


def spelled(text: str, name: Naming = library_name) -> str:
    """``text`` with its options named by ``name`` where it is :class:`Tagged`."""
    return text.spelled(name) if isinstance(text, Tagged) else text
