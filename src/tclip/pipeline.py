"""Deprecated (use the API of docs/python.md). The former public path
of the one-file steps (README, "Python"): pass 1, the plan, pass 2,
and their compositions. The code lives in :mod:`tclip.work`.

    from tclip.pipeline import clip_file, report_file, file_info, ClipOptions, Selection
"""

from __future__ import annotations

import warnings

from .core.modes import AverageNormClip, GlobalNormClip, NormClip, ValueClip
from .work.clip import clip_file, file_info, report_file
from .work.inputs import default_output
from .work.options import ClipOptions
from .work.plan import Plan, TensorWork, make_plan
from .work.rewrite import RewriteResult, rewrite_file
from .work.selection import Selection
from .work.statistics import FileStats, file_statistics

warnings.warn("tclip.pipeline is deprecated and will be removed: use tclip.open/report/clip/diff/summary "
              "(docs/python.md), or "
              "tclip.work.clip (clip_file, report_file, file_info), tclip.work.options, "
              "tclip.work.selection", DeprecationWarning, stacklevel=2)

__all__ = [
    "ClipOptions",
    "Selection",
    "FileStats",
    "Plan",
    "TensorWork",
    "RewriteResult",
    "file_statistics",
    "make_plan",
    "rewrite_file",
    "clip_file",
    "report_file",
    "file_info",
    "default_output",
    "NormClip",
    "AverageNormClip",
    "GlobalNormClip",
    "ValueClip",
]
