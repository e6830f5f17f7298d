"""The journal of an in-place rewrite of a sharded checkpoint.

``--in-place`` on an index keeps a journal beside it
(``NAME.index.json.tclip-journal``) and marks the index while shards are being
replaced; see README ("Sharded checkpoints") for what a crash leaves and how to
resume. A shard's task leaves a commit marker just before its rename, so a run
killed between a rename and the journal's record still resumes."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from ..errors import TclipError
from ..formats.atomic import marker_names, write_json
from ..formats.sharded import IN_PROGRESS_KEY, TensorSet, no_duplicate_keys
from .options import ClipOptions
from .plan import Plan
from .reporting import mode_params
from .statistics import FileStats

JOURNAL_SUFFIX = ".tclip-journal"


MARKER_SUFFIX = ".tclip-commit"


def journal_path(tensor_set: TensorSet) -> Path:
    assert tensor_set.index is not None
    return tensor_set.index.with_name(tensor_set.index.name + JOURNAL_SUFFIX)


def mark_index(tensor_set: TensorSet, journal: Path) -> None:
    """While shards are replaced in place, the index says so (and where the journal is)."""
    assert tensor_set.index is not None
    data = json.loads(json.dumps(tensor_set.index_data))
    metadata = dict(data.get("metadata") or {})
    metadata[IN_PROGRESS_KEY] = (f"tclip is replacing this checkpoint's shards in place; until this key is gone "
                                 f"some shards may be clipped and others not. See {journal.name}.")
    data["metadata"] = metadata
    write_json(tensor_set.index, data, tensor_set.index)


def write_journal(journal: Path, tensor_set: TensorSet, mode: Any, options: ClipOptions, stats: list[FileStats],
                   plan: Plan) -> None:
    """What an unfinished in-place run needs to finish: the plan's one number (the
    global norm, in exact hex form) and which shards are done. Plain JSON."""
    state = {
        "tclip_journal": 1,
        "mode": mode.name,
        "params": {k: (v.hex() if isinstance(v, float) else v) for k, v in mode_params(mode).items()},
        "selection": [list(options.selection.include), list(options.selection.exclude)],
        "global_norm": None if plan.global_norm is None else float(plan.global_norm).hex(),
        "done": [],
        "files": {str(f): [os.stat(f).st_size, os.stat(f).st_mtime_ns] for f in tensor_set.files},
    }
    write_json(journal, state)


def commit_marker(shard: Path) -> Path:
    """Where the task that replaces ``shard`` in place says, just before the rename,
    which file is about to take its name (see :meth:`AtomicOutput.commit`): a crash
    after the rename and before the journal records it leaves the marker, and the
    resumed run recognises the shard as done instead of refusing it as changed."""
    shard = Path(shard)
    return shard.with_name(f".{shard.name}{MARKER_SUFFIX}")


def journal_done(journal: Path, file: Path) -> None:
    state = json.loads(journal.read_text(encoding="utf-8"))
    state["done"].append(str(file))
    state["files"][str(file)] = [os.stat(file).st_size, os.stat(file).st_mtime_ns]
    write_json(journal, state)
    commit_marker(file).unlink(missing_ok=True)


def read_journal(journal: Path, mode: Any, options: ClipOptions, record: bool = True) -> dict[str, Any] | None:
    """The state of an unfinished in-place run, to finish it; None when there is none.
    ``record`` False (a dry run) writes nothing, not even a shard found done."""
    if not journal.exists():
        return None
    try:
        state = json.loads(journal.read_text(encoding="utf-8"), object_pairs_hook=no_duplicate_keys)
        params = {k: (float.fromhex(v) if isinstance(v, str) else v) for k, v in state["params"].items()}
        same = (state["mode"] == mode.name and params == mode_params(mode)
                and state["selection"] == [list(options.selection.include), list(options.selection.exclude)])
        done, files = list(state["done"]), dict(state["files"])
        global_norm = None if state["global_norm"] is None else float.fromhex(state["global_norm"])
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        raise TclipError("the journal of an unfinished run is unreadable; restore the checkpoint from a copy "
                         "or remove the journal", journal) from None
    if not same:
        raise TclipError(f"an unfinished {state['mode']} run with other parameters left this journal; finish it "
                         "with the same command, or restore the checkpoint and remove the journal", journal)
    for file, (size, mtime) in files.items():
        if not os.path.exists(file):
            raise TclipError(f"shard {file} named by the journal is missing", journal)
        if (os.stat(file).st_size, os.stat(file).st_mtime_ns) != (size, mtime):
            if file not in done and marker_names(commit_marker(Path(file)), Path(file)):
                if record:
                    journal_done(journal, Path(file))  # replaced just before the crash: done
                done.append(file)
                continue
            raise TclipError(f"shard {file} changed since the unfinished run wrote its journal; "
                             "cannot resume safely", journal)
    return {"done": done, "global_norm": global_norm}
