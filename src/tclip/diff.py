"""The stable public path of ``tclip diff`` (README, "Python"): ``from tclip.diff import diff_files``.
The code lives in :mod:`tclip.work.diff`.
"""

from __future__ import annotations

from .work.diff import DiffReport, TensorDiff, diff_files
from .work.mapping import apply_mapping, parse_mapping

__all__ = ["diff_files", "parse_mapping", "apply_mapping", "DiffReport", "TensorDiff"]
