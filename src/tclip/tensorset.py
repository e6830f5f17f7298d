"""The stable public path of tensor sets (README, "Python"): ``tclip.tensorset.clip_set`` and
its companions. The code lives in :mod:`tclip.work.clip`, :mod:`tclip.work.sets` and :mod:`tclip.formats.sharded`.
"""

from __future__ import annotations

from .formats.sharded import SetReader, TensorSet, is_index, load_index, open_any
from .work.clip import clip_set
from .work.sets import group_sets, index_info, report_set, set_info

__all__ = ["TensorSet", "SetReader", "clip_set", "report_set", "index_info", "set_info", "group_sets", "is_index",
           "load_index", "open_any"]
