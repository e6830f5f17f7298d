"""The exceptions tclip raises for bad input files and failed work.

Argument errors in the NumPy core are plain ``ValueError``/``TypeError``, as in
TensorFlow; everything that concerns a file is a :class:`TclipError`, whose
message already names the file, so the CLI can print it as one line.
"""

from __future__ import annotations


class TclipError(Exception):
    """Something tclip could not do; the message is meant for the user."""

    def __init__(self, message: str, path: object = None) -> None:
        self.path = None if path is None else str(path)
        self.detail = message
        super().__init__(f"{self.path}: {message}" if self.path else message)


class FormatError(TclipError):
    """A file is malformed, truncated or not a tensor file tclip knows."""


class UnsupportedError(TclipError):
    """The file is valid but holds something tclip cannot carry (e.g. objects)."""


class OutputExistsError(TclipError):
    """The output exists and replacing it was not asked for."""


class NonFiniteError(TclipError):
    """Selected tensors hold NaN or Inf and the policy is to refuse them."""


class CheckFailedError(TclipError):
    """A check the user asked for (e.g. --max-norm) failed."""
