"""The exceptions tclip raises for bad input files and failed work.

Argument errors in the NumPy core are plain ``ValueError``/``TypeError``, as in
TensorFlow; everything that concerns a file is a :class:`TclipError`, whose
message already names the file, so the command line prints it as one line. A
message may name options the user can change (:mod:`tclip.messages`): ``str()``
names them as the library does, :meth:`TclipError.spelled` as the caller does.
"""

from __future__ import annotations

from .messages import Message, Naming, library_name, spell


class TclipError(Exception):
    """Something tclip could not do; the message is meant for the user."""

    def __init__(self, message: Message, path: object = None) -> None:
        self.path = None if path is None else str(path)
        self.message = message
        self.detail = spell(message)
        super().__init__(f"{self.path}: {self.detail}" if self.path else self.detail)

    def spelled(self, name: Naming = library_name) -> str:
        """The whole message (the file first) with its options named by ``name``."""
        detail = spell(self.message, name)
        return f"{self.path}: {detail}" if self.path else detail


class FormatError(TclipError):
    """A file is malformed, truncated or not a tensor file tclip knows."""


class UnsupportedError(TclipError):
    """The file is valid but holds something tclip cannot carry (e.g. objects)."""


class NoTensorsError(UnsupportedError):
    """The file holds pickled Python objects and no tensor tclip reads (a Trainer's ``rng_state.pth``)."""


class OutputExistsError(TclipError):
    """The output exists and replacing it was not asked for."""


class NonFiniteError(TclipError):
    """Selected tensors hold NaN or Inf and the policy is to refuse them."""
