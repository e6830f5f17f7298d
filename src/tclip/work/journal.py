"""The journal of an in-place rewrite of a sharded checkpoint.

``--in-place`` on an index keeps a journal beside it
(``NAME.index.json.tclip-journal``) and marks the index while shards are being
replaced; see README ("Sharded checkpoints") for what a crash leaves and how to
resume. A shard's task leaves a commit marker just before its rename, so a run
killed between a rename and the journal's record still resumes."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

from ..core.modes import GlobalNormClip
from ..errors import TclipError
from ..formats.atomic import marker_names, write_json
from ..formats.sharded import IN_PROGRESS_KEY, TensorSet, no_duplicate_keys
from .options import ClipOptions
from .plan import Plan
from .reporting import mode_params
from .statistics import FileStats

JOURNAL_SUFFIX = ".tclip-journal"
JOURNAL_VERSION = 2  # 2: shards named relative to the index's folder (1: as the command spelled the path)
JOURNAL_KEYS = frozenset({"tclip_journal", "mode", "params", "selection", "global_norm", "done", "files"})
# A journal names each shard once with two numbers: even 100,000 shards take a few MiB.
MAX_JOURNAL_BYTES = 64 << 20


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
    # A symlinked index (a Hugging Face cache's snapshot) stays a link: its target is marked.
    target = Path(os.path.realpath(tensor_set.index))
    write_json(target, data, target)


def shard_names(tensor_set: TensorSet) -> dict[str, Path]:
    """Each shard of an indexed set by the name the journal gives it: its path relative
    to the index's folder, so that a journal means the same from any working folder."""
    assert tensor_set.index is not None
    folder = tensor_set.index.parent
    return {Path(f).relative_to(folder).as_posix(): Path(f) for f in tensor_set.files}


def _stamp(file: Path) -> list[int]:
    st = os.stat(file)
    return [st.st_size, st.st_mtime_ns]


def _params(mode: Any) -> dict[str, Any]:
    """The mode's parameters as the journal writes them: floats in exact hex form."""
    return {k: (v.hex() if isinstance(v, float) else v) for k, v in mode_params(mode).items()}


def _selection(options: ClipOptions) -> list[list[str]]:
    return [list(options.selection.include), list(options.selection.exclude)]


def write_journal(journal: Path, tensor_set: TensorSet, mode: Any, options: ClipOptions, stats: list[FileStats],
                  plan: Plan) -> None:
    """What an unfinished in-place run needs to finish: the plan's one number (the
    global norm, in exact hex form) and which shards are done. Plain JSON."""
    state = {
        "tclip_journal": JOURNAL_VERSION,
        "mode": mode.name,
        "params": _params(mode),
        "selection": _selection(options),
        "global_norm": None if plan.global_norm is None else float(plan.global_norm).hex(),
        "done": [],
        "files": {name: _stamp(file) for name, file in shard_names(tensor_set).items()},
    }
    write_json(journal, state)


def commit_marker(shard: Path) -> Path:
    """Where the task that replaces ``shard`` in place says, just before the rename,
    which file is about to take its name (see :meth:`AtomicOutput.commit`): a crash
    after the rename and before the journal records it leaves the marker, and the
    resumed run recognises the shard as done instead of refusing it as changed."""
    shard = Path(shard)
    return shard.with_name(f".{shard.name}{MARKER_SUFFIX}")


def journal_done(journal: Path, tensor_set: TensorSet, file: Path) -> None:
    """Record that ``file`` (a shard of the set) has been replaced."""
    names = {path: name for name, path in shard_names(tensor_set).items()}
    state = json.loads(journal.read_text(encoding="utf-8"))
    name = names[Path(file)]
    if name not in state["done"]:
        state["done"].append(name)
    state["files"][name] = _stamp(file)
    write_json(journal, state)
    commit_marker(file).unlink(missing_ok=True)


class _Invalid(Exception):
    """A journal field that is not what tclip writes (the text says which and why)."""


class _OtherRun(Exception):
    """A valid journal of a run with another mode, other parameters or another selection."""


def _is_int(value: Any) -> bool:
    return type(value) is int  # JSON true/false are bools, and bools are ints in Python


def _hex_float(value: Any, what: str) -> float:
    """An exact float as :meth:`float.hex` writes it, finite and not negative."""
    if not isinstance(value, str) or len(value) > 64:
        raise _Invalid(f"{what} is not a float in hex form")
    try:
        number = float.fromhex(value)
    except (ValueError, OverflowError):
        raise _Invalid(f"{what} is not a float in hex form") from None
    if not math.isfinite(number) or number < 0 or number.hex() != value:
        raise _Invalid(f"{what} is {number!r}, not a finite number >= 0 in hex form")
    return number


def _check_state(state: Any, tensor_set: TensorSet, mode: Any, options: ClipOptions) -> tuple[list[str],
                                                                                               float | None]:
    """The journal's (done, global norm) when every field is what this command and set would
    write; else :class:`_Invalid` naming the first field that is not."""
    if not isinstance(state, dict):
        raise _Invalid("it is not a JSON object")
    if set(state) != JOURNAL_KEYS:
        odd = sorted(set(state) ^ JOURNAL_KEYS)
        raise _Invalid(f"its fields are not the journal's ({', '.join(repr(k)[:40] for k in odd[:3])})")
    if not _is_int(state["tclip_journal"]) or state["tclip_journal"] != JOURNAL_VERSION:
        raise _Invalid("its version is not one this tclip writes")
    if not isinstance(state["mode"], str):
        raise _Invalid("mode is not a name")
    same = (state["mode"] == mode.name and state["params"] == _params(mode)
            and state["selection"] == _selection(options))
    if not same:
        raise _OtherRun(state["mode"])
    shards = shard_names(tensor_set)
    files = state["files"]
    if not isinstance(files, dict) or set(files) != set(shards):
        raise _Invalid("files does not name exactly the index's shards")
    for name, stamp in files.items():
        if not (isinstance(stamp, list) and len(stamp) == 2 and all(_is_int(v) and v >= 0 for v in stamp)):
            raise _Invalid(f"the files entry of {name} is not [size, mtime] in whole numbers")
    done = state["done"]
    if not isinstance(done, list) or not all(isinstance(name, str) for name in done):
        raise _Invalid("done is not a list of shard names")
    strangers = [name for name in done if name not in shards]
    if strangers:
        raise _Invalid(f"done names {strangers[0][:80]!r}, not a shard of the index")
    if len(set(done)) != len(done):
        twice = next(name for name in done if done.count(name) > 1)
        raise _Invalid(f"done names shard {twice[:80]} twice")
    wants_norm = isinstance(mode, GlobalNormClip)
    if state["global_norm"] is None:
        if wants_norm:
            raise _Invalid("global_norm is missing")
        return list(done), None
    if not wants_norm:
        raise _Invalid(f"global_norm is given for a {mode.name} run")
    return list(done), _hex_float(state["global_norm"], "global_norm")


def read_journal(journal: Path, tensor_set: TensorSet, mode: Any, options: ClipOptions,
                 record: bool = True) -> dict[str, Any] | None:
    """The state of an unfinished in-place run, to finish it; None when there is none.

    The journal is a file on disk like any other: every field is checked against what
    this command would have written for this set, and anything else is one error.
    ``record`` False (a dry run) writes nothing, not even a shard found done."""
    if not journal.exists():  # a dangling link there is no journal (and is replaced, never followed)
        return None
    advice = "restore the checkpoint from a copy, or remove the journal"
    try:
        if os.stat(journal).st_size > MAX_JOURNAL_BYTES:
            raise _Invalid(f"it is larger than {MAX_JOURNAL_BYTES >> 20} MiB")
        state = json.loads(journal.read_text(encoding="utf-8"), object_pairs_hook=no_duplicate_keys)
        done, global_norm = _check_state(state, tensor_set, mode, options)
    except (OSError, ValueError, RecursionError):
        raise TclipError(f"the journal of an unfinished run is unreadable; {advice}", journal) from None
    except _OtherRun as other:
        raise TclipError(f"an unfinished {str(other)[:40]} run with other parameters left this journal; finish it "
                         "with the same command, or restore the checkpoint and remove the journal", journal) from None
    except _Invalid as problem:
        raise TclipError(f"the journal of an unfinished run is not valid ({problem}); {advice}", journal) from None
    shards = shard_names(tensor_set)
    for name, (size, mtime) in state["files"].items():
        file = shards[name]
        if not os.path.exists(file):
            raise TclipError(f"shard {name} named by the journal is missing", journal)
        if _stamp(file) != [size, mtime]:
            if name not in done and marker_names(commit_marker(file), file):
                if record:
                    journal_done(journal, tensor_set, file)  # replaced just before the crash: done
                done.append(name)
                continue
            raise TclipError(f"shard {name} changed since the unfinished run wrote its journal; "
                             "cannot resume safely", journal)
    return {"done": [shards[name] for name in done], "global_norm": global_norm}
