"""What the command line calls the library's options when a message names them.

The library says ``nonfinite='propagate'`` (:class:`~tclip.messages.Option`); the
command line says ``--nonfinite propagate``. Every error line, warning and JSON
message the command line prints goes through :func:`flag`.
"""

from __future__ import annotations

from ..messages import Option

FLAGS = {
    Option.FORCE: "--force",
    Option.EXCLUDE: "--exclude",
    Option.INCLUDE: "--include",
    Option.PROPAGATE: "--nonfinite propagate",
    Option.DROP_NONNUMERIC: "--drop-nonnumeric",
    Option.MEMORY: "--memory",
    Option.IN_PLACE: "--in-place",
    Option.OUT_DIR: "--out-dir",
    Option.AXES: "--axes",
    Option.MAP: "--map",
    Option.DASK: "--dask",
    Option.TENSORS_ONLY: "--tensors-only",
}


def flag(option: Option) -> str:
    """The flag that sets ``option``."""
    return FLAGS[option]
