"""A run's history as a grid: tensors x checkpoints (``report --summary --of norms|grads|drift``).

- ``norms``: each tensor's own norm in each file (from the per-file reports);
- ``grads``: from Adam-like optimizer state (:mod:`.adam`), per parameter and
  checkpoint the interval gradient norm since the previous checkpoint (the cell
  value: it pins a spike to one interval) and the bias-corrected EMA norm;
- ``drift``: ``||W_t - W_{t-1}|| / ||W_{t-1}||`` per tensor between consecutive
  files, summed exactly and streamed block by block by :func:`tclip.work.diff.diff_files`.

A checkpoint is one file, or, when the inputs lie in several folders (Hugging Face
Trainer's ``checkpoint-N/``), the files of one folder. The grid is plain data; the
pictures and tables are drawn at the edge (``cli/render``).
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import TclipError
from ..messages import Tagged
from ..text import natural_key
from . import adam
from .results import SCHEMA_VERSION, FileReport, json_safe
from .selection import Selection

TOP_CELLS = 10


class HistoryNoteKind(enum.Enum):
    """What a checkpoint's note says, for code (its text is for people)."""

    NO_OPTIMIZER_FILE = "no optimizer file"
    NO_ADAM_STATE = "no Adam-like state"
    STATE_INCOMPLETE = "state incomplete"
    NUMBERED = "parameters numbered"
    UNTRUSTED_INTERVAL = "interval not trusted"


class HistoryNote(Tagged):
    """A note on one checkpoint of a history: its text and its :class:`HistoryNoteKind`."""

    kind: HistoryNoteKind


@dataclass
class Grid:
    """Values of tensors (rows) across checkpoints (columns, in step order).

    ``values[r][c]`` is None where the tensor has no value in that column (absent, not
    measured, or the first column of a drift); NaN/Inf are values.
    """

    quantity: str
    columns: list[str]                      # the checkpoints (a file or a folder), in step order
    rows: list[str]                         # tensor names, natural order (grouped by layer number)
    values: list[list[float | None]]
    notes: dict[str, list[HistoryNote]] = field(default_factory=dict)  # column -> what was not measured, why
    extra: dict[str, list[dict[str, Any]]] = field(default_factory=dict)  # column -> per-tensor details (JSON)
    steps: list[float | None] = field(default_factory=list)     # grads: the largest step of each column
    unmeasured: list[tuple[str, str, str]] = field(default_factory=list)  # (tensor, column, why)

    def array(self) -> np.ndarray:
        """The values as a float64 array, NaN for both NaN values and None (use :meth:`present`)."""
        out = np.full((len(self.rows), len(self.columns)), np.nan)
        for r, row in enumerate(self.values):
            for c, v in enumerate(row):
                if v is not None:
                    out[r, c] = v
        return out

    def present(self) -> np.ndarray:
        return np.array([[v is not None for v in row] for row in self.values], dtype=bool).reshape(
            len(self.rows), len(self.columns))


def row_medians(grid: Grid) -> list[float | None]:
    """Each row's median over its finite, positive values (the scale colours are relative to)."""
    out: list[float | None] = []
    for row in grid.values:
        good = [v for v in row if v is not None and math.isfinite(v) and v > 0]
        out.append(float(np.median(good)) if good else None)
    return out


def departures(grid: Grid, top: int = TOP_CELLS) -> list[dict[str, Any]]:
    """The cells farthest from their row's median in log terms, NaN/Inf first:
    ``{"tensor", "column", "value", "median", "ratio"}``."""
    medians = row_medians(grid)
    cells = []
    for r, row in enumerate(grid.values):
        for c, v in enumerate(row):
            if v is None:
                continue
            median = medians[r]
            if not math.isfinite(v):
                score, ratio = math.inf, math.nan
            elif median is None:
                continue
            elif v <= 0:
                score, ratio = math.inf, 0.0
            else:
                ratio = v / median
                score = abs(math.log(ratio))
            if score > 0:
                cells.append((score, r, c, ratio, v, median))
    cells.sort(key=lambda x: (-x[0], natural_key(grid.rows[x[1]]), x[2]))
    return [{"tensor": grid.rows[r], "column": grid.columns[c], "value": v, "median": m, "ratio": ratio}
            for _, r, c, ratio, v, m in cells[:top]]


# --------------------------------------------------------------------------- checkpoints

def checkpoints(paths: list[Path]) -> list[tuple[str, list[Path]]]:
    """The inputs grouped into checkpoints: each file alone, or, when they lie in several
    folders, the files of each folder together (named by the folder)."""
    folders: dict[str, list[Path]] = {}
    for p in paths:
        folders.setdefault(str(p.parent), []).append(p)
    if len(folders) <= 1:
        return [(str(p), [p]) for p in paths]
    return list(folders.items())


def _file_order(paths: list[Path], sort: str) -> list[Path]:
    return list(paths) if sort == "order" else sorted(paths, key=lambda p: natural_key(str(p)))


# --------------------------------------------------------------------------- norms

def norms_grid(reports: list[FileReport]) -> Grid:
    """Each tensor's norm in each file (``reports`` in step order)."""
    names: dict[str, None] = {}
    for report in reports:
        for t in report.tensors:
            names.setdefault(t.name, None)
    rows = sorted(names, key=natural_key)
    index = {n: i for i, n in enumerate(rows)}
    values: list[list[float | None]] = [[None] * len(reports) for _ in rows]
    for c, report in enumerate(reports):
        for t in report.tensors:
            if t.norm is not None:
                values[index[t.name]][c] = t.norm
    return Grid("norms", [r.file for r in reports], rows, values)


# --------------------------------------------------------------------------- grads

def grads_grid(paths: list[Path], sort: str = "name", selection: Selection | None = None) -> Grid:
    """The interval gradient norms (cells) and the EMA norms of every checkpoint's Adam state.

    A checkpoint without such state, or whose optimizer is not Adam-like, gets a note and
    an empty column; files that cannot be read raise (the caller reports them).
    """
    from ..formats.registry import open_reader

    selection = selection or Selection()
    groups = checkpoints(_file_order(paths, sort))
    per_column: list[dict[str, adam.ParamState]] = []
    notes: dict[str, list[HistoryNote]] = {}
    for column, files in groups:
        states: dict[str, adam.ParamState] = {}
        found = _state_in(files, open_reader, notes.setdefault(column, []))
        for p in found:
            if selection.matches(p.name):
                states[p.name] = p
        per_column.append(states)
    names = sorted({n for s in per_column for n in s}, key=natural_key)
    values: list[list[float | None]] = [[None] * len(groups) for _ in names]
    extra: dict[str, list[dict[str, Any]]] = {}
    steps: list[float | None] = []
    for c, (column, _) in enumerate(groups):
        details: list[dict[str, Any]] = []
        states = per_column[c]
        steps.append(max((st.step for st in states.values()), default=None))
        for r, name in enumerate(names):
            state = states.get(name)
            if state is None:
                continue
            before = _previous_state(per_column, c, name)
            span = adam.interval(before, state)
            values[r][c] = span.norm
            s = adam.ema_sq(state)
            details.append({
                "name": name, "key": state.key, "shape": list(state.shape), "step": state.step,
                "beta2": state.beta2, "sum_exp_avg_sq": state.sum_sq, "ema_sq": s,
                "ema_norm": math.sqrt(s) if s >= 0 else math.nan,
                "interval": {"after_step": span.first_step, "to_step": span.last_step, "mean_sq": span.mean_sq,
                             "norm": span.norm, "conditioning": span.conditioning, "trusted": span.trusted,
                             "clamped_at_zero": span.clamped},
            })
        extra[column] = details
        for d in details:
            span_d = d["interval"]
            if not span_d["trusted"] and span_d["mean_sq"] is not None:
                text = (f"{d['name']}: the interval after step {span_d['after_step']:g} is too badly conditioned "
                        f"to trust (conditioning {span_d['conditioning']:.3g}"
                        + ("; negative, shown as 0)" if span_d["clamped_at_zero"] else ")"))
                notes[column].append(HistoryNote(HistoryNoteKind.UNTRUSTED_INTERVAL, text))
    return Grid("grads", [g for g, _ in groups], names, values, notes, extra, steps)


def _previous_state(per_column: list[dict[str, adam.ParamState]], c: int, name: str) -> adam.ParamState | None:
    """The parameter's state in the previous checkpoint (None: none before, as at step 0)."""
    if c == 0:
        return None
    return per_column[c - 1].get(name)


_OPTIMIZER_HINTS = ("optim",)
_MODEL_HINTS = ("model", "pytorch_model", "adapter_model", "consolidated")


def _state_in(files: list[Path], open_reader: Any, notes: list[HistoryNote]) -> list[adam.ParamState]:
    """The Adam state of one checkpoint, named; what is missing goes to ``notes``."""
    single = len(files) == 1
    state_files = files if single else [f for f in files if any(h in f.name.lower() for h in _OPTIMIZER_HINTS)]
    model_files = [] if single else [f for f in files if f not in state_files
                                     and any(f.name.lower().startswith(h) for h in _MODEL_HINTS)]
    if not state_files:
        notes.append(HistoryNote(HistoryNoteKind.NO_OPTIMIZER_FILE,
                                 "no optimizer file (optimizer.pt) in this checkpoint: no gradient history"))
        return []
    out: list[adam.ParamState] = []
    for path in state_files:
        with open_reader(path) as reader:
            prefixes = adam.optimizer_prefixes(reader)
            if not prefixes:
                notes.append(HistoryNote(HistoryNoteKind.NO_ADAM_STATE, adam.not_adam(reader) or
                                         f"{path.name}: no Adam-like optimizer state (exp_avg_sq with a step "
                                         "count and beta2)"))
                continue
            for prefix in prefixes:
                state = adam.read_state(reader, prefix)
                if state.missing:
                    notes.append(HistoryNote(HistoryNoteKind.STATE_INCOMPLETE, f"{path.name}: {state.missing}"))
                    continue
                groups = [[str(k) for k in g.get("params") or []] for g in adam.group_settings(reader, prefix)]
                model, ordered = (_model_part(reader, prefix), True) if single else ([], True)
                if not model:
                    model, ordered = _model_files(model_files or _beside(path), open_reader)
                adam.name_params(state, model, ordered, groups)
                if state.naming:
                    notes.append(HistoryNote(HistoryNoteKind.NUMBERED, state.naming))
                out += state.params
    return out


def _beside(path: Path) -> list[Path]:
    """The model files in an optimizer file's folder (Trainer's ``model.safetensors``), when it was named alone."""
    from .inputs import is_tensor_file

    try:
        found = sorted(path.parent.iterdir(), key=lambda p: natural_key(str(p)))
    except OSError:
        return []
    models = [f for f in found if f != path and f.is_file() and any(f.name.lower().startswith(h) for h in _MODEL_HINTS)
              and not any(h in f.name.lower() for h in _OPTIMIZER_HINTS) and is_tensor_file(f)]
    indexes = [f for f in models if f.name.endswith(".index.json")]
    return indexes[:1] if indexes else models


def _model_part(reader: Any, prefix: str) -> list[tuple[str, tuple[int, ...]]]:
    """The floating tensors of a file that are not its optimizer's state, in file order."""
    from ..core.dtypes import is_floating
    from ..errors import UnsupportedError

    tied: set[str] = set()
    try:
        # tied weights (lm_head = embedding) are two names in a state dict but one parameter
        tied = {o.second for o in getattr(reader, "overlaps", lambda: [])() if o.same}
    except UnsupportedError:
        pass
    return [(n, tuple(i.shape)) for n, i in reader.tensors.items()
            if not (prefix and n.startswith(prefix)) and not n.startswith(f"{prefix}state.")
            and not i.optimizer_state and is_floating(i.dtype) and n not in tied]


def _model_files(files: list[Path], open_reader: Any) -> tuple[list[tuple[str, tuple[int, ...]]], bool]:
    """The model tensors beside an optimizer file, and whether their order is the module order
    (a pickled state dict keeps it; safetensors files list their tensors sorted by name)."""
    model: list[tuple[str, tuple[int, ...]]] = []
    ordered = True
    for path in sorted(files, key=lambda p: natural_key(str(p))):
        if path.name.endswith(".index.json") and len(files) > 1:
            continue
        with open_reader(path) as reader:
            model += _model_part(reader, "\0")
            ordered = ordered and reader.format_name == "pytorch" and len(files) == 1
    return model, ordered


# --------------------------------------------------------------------------- drift

def drift_grid(paths: list[Path], sort: str = "name", selection: Selection | None = None,
               memory: int | None = None, threads: int = 0) -> Grid:
    """``||W_t - W_{t-1}|| / ||W_{t-1}||`` per tensor between consecutive files."""
    from .diff import Status, diff_files

    files = [_model_file(group) for _, group in checkpoints(_file_order(paths, sort))]
    selection = selection or Selection()
    columns = [str(p) for p in files]
    table: dict[str, list[float | None]] = {}
    notes: dict[str, list[HistoryNote]] = {c: [] for c in columns}
    extra: dict[str, list[dict[str, Any]]] = {c: [] for c in columns}
    skip = _optimizer_globs(files[0]) if files else ()
    chosen = Selection(selection.include, selection.exclude + skip)
    unmeasured: list[tuple[str, str, str]] = []
    for c in range(1, len(files)):
        kwargs: dict[str, Any] = {"selection": chosen, "threads": threads}
        if memory is not None:
            kwargs["memory"] = memory
        report = diff_files(files[c - 1], files[c], **kwargs)
        for t in report.tensors:
            name = t.name_b or t.name
            if t.status is Status.COMPARED and t.diff_norm is not None and t.norm_a is not None:
                value = _relative(t.diff_norm, t.norm_a)
                table.setdefault(name, [None] * len(files))[c] = value
                extra[columns[c]].append({"name": name, "drift": value, "diff_norm": t.diff_norm,
                                          "norm_before": t.norm_a, "norm_after": t.norm_b})
            elif isinstance(t.dtype_a or t.dtype_b, np.dtype):  # a tensor (objects that are not are no weights)
                unmeasured.append((name, columns[c], str(t.status)))
    rows = sorted(table, key=natural_key)
    return Grid("drift", columns, rows, [table[n] for n in rows], notes, extra, unmeasured=unmeasured)


def _model_file(files: list[Path]) -> Path:
    """The model's file among a checkpoint folder's files (its weights, not its optimizer)."""
    if len(files) == 1:
        return files[0]
    models = [f for f in files if not any(h in f.name.lower() for h in _OPTIMIZER_HINTS)
              and any(f.name.lower().startswith(h) for h in _MODEL_HINTS)]
    if len(models) != 1:
        raise TclipError(f"no single model file among {', '.join(f.name for f in files)}: name the files to "
                         "compare", files[0].parent)
    return models[0]


def _relative(diff: float, before: float) -> float:
    if before > 0 and math.isfinite(before):
        return diff / before
    if diff == 0:
        return 0.0
    return math.inf if math.isfinite(diff) else math.nan


def _optimizer_globs(path: Path) -> tuple[str, ...]:
    """Exclusions for a file's optimizer state (drift is of the weights)."""
    from ..formats.registry import open_reader

    try:
        with open_reader(path) as reader:
            return tuple(f"{p}state.*" for p in adam.optimizer_prefixes(reader)) + tuple(
                n for n, i in reader.tensors.items() if i.optimizer_state)
    except (TclipError, OSError):
        return ()


def drift_violations(grid: Grid, limit: float) -> list[tuple[str, str, str, float | None]]:
    """Tensors whose drift exceeds ``limit`` or is NaN, or that were not measured:
    ``(tensor, file before, file after, drift)``."""
    out: list[tuple[str, str, str, float | None]] = []
    for r, row in enumerate(grid.values):
        for c, v in enumerate(row):
            if c and v is not None and (math.isnan(v) or v > limit):
                out.append((grid.rows[r], grid.columns[c - 1], grid.columns[c], v))
    for name, column, _ in grid.unmeasured:
        i = grid.columns.index(column)
        out.append((name, grid.columns[i - 1] if i else column, column, None))
    return out


# --------------------------------------------------------------------------- JSON

def grid_json(grid: Grid, labels: dict[str, str]) -> list[dict[str, Any]]:
    """One object per column (checkpoint), in step order, with every value and detail."""
    items = []
    for c, column in enumerate(grid.columns):
        item: dict[str, Any] = {
            "schema": SCHEMA_VERSION, "mode": "summary", "of": grid.quantity, "file": column,
            "label": labels.get(column, column), "previous": grid.columns[c - 1] if c else None,
        }
        if grid.quantity == "grads":
            item["step"] = grid.steps[c] if c < len(grid.steps) else None
            item["tensors"] = grid.extra.get(column, [])
            ema = [d["ema_sq"] for d in item["tensors"]]
            item["global_ema_norm"] = math.sqrt(math.fsum(ema)) if ema and all(math.isfinite(e) for e in ema) \
                else (math.nan if ema else None)
            spans = {(d["interval"]["after_step"], d["interval"]["to_step"], d["beta2"]) for d in item["tensors"]}
            means = [d["interval"]["mean_sq"] for d in item["tensors"]]
            item["global_interval_norm"] = math.sqrt(math.fsum(means)) \
                if len(spans) == 1 and all(m is not None and math.isfinite(m) for m in means) else None
        elif grid.quantity == "drift":
            item["tensors"] = grid.extra.get(column, [])
        else:
            item["tensors"] = [{"name": n, "norm": grid.values[r][c]} for r, n in enumerate(grid.rows)
                               if grid.values[r][c] is not None]
        item["notes"] = grid.notes.get(column, [])
        item["not_measured"] = [{"name": n, "why": why} for n, col, why in grid.unmeasured if col == column]
        items.append(json_safe(item))
    return items

