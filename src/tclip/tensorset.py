"""Deprecated (use the API of docs/python.md). The former public path
of tensor sets: ``tclip.tensorset.clip_set`` and its companions. The code lives in
:mod:`tclip.work.clip`, :mod:`tclip.work.sets` and :mod:`tclip.formats.sharded`.
"""

from __future__ import annotations

import warnings

from .formats.sharded import SetReader, TensorSet, is_index, load_index, open_any
from .work.clip import clip_set
from .work.sets import group_sets, index_info, report_set, set_info

warnings.warn("tclip.tensorset is deprecated and will be removed: use tclip.open/report/clip/diff/summary "
              "(docs/python.md), or "
              "tclip.work.clip (clip_set), tclip.work.sets (report_set, set_info) and tclip.formats.sharded",
              DeprecationWarning, stacklevel=2)

__all__ = ["TensorSet", "SetReader", "clip_set", "report_set", "index_info", "set_info", "group_sets", "is_index",
           "load_index", "open_any"]
