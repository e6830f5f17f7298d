"""Deprecated (use the API of docs/python.md). The former public path
of tensor sets (README, "Python"): ``tclip.tensorset.clip_set`` and
its companions. The code lives in :mod:`tclip.work.sets` and :mod:`tclip.formats.sharded`.
"""

from __future__ import annotations

import warnings

from .formats.sharded import SetReader, TensorSet, is_index, load_index, open_any
from .work.sets import clip_set, group_sets, index_info, report_set

warnings.warn("tclip.tensorset is deprecated and will be removed: use tclip.open/report/clip/diff/summary "
              "(docs/python.md), or "
              "tclip.work.sets (clip_set, report_set, index_info) and tclip.formats.sharded",
              DeprecationWarning, stacklevel=2)

__all__ = ["TensorSet", "SetReader", "clip_set", "report_set", "index_info", "group_sets", "is_index",
           "load_index", "open_any"]
