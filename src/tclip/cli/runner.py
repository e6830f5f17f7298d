"""What each command does with its files: expand them, run the library per tensor set (a file is
a set of one), print tables or JSON Lines, map errors to one line each, and decide the exit status.

Kept apart from :mod:`tclip.cli` so that parsing options imports nothing heavy.
"""

from __future__ import annotations

import functools
import json
import os
import sys
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..errors import TclipError
from ..messages import spelled
from ..text import name_list, safe
from ..work.results import Note, NoteKind
from .exits import EXIT_BROKEN_PIPE, EXIT_CHECK_FAILED, EXIT_FAILED, quiet_stdout
from .words import flag

if TYPE_CHECKING:
    from ..work.inputs import Found

# Runs smaller than this take well under a second: no progress bar flashing by.
PROGRESS_MIN_BYTES = 64 << 20
UNLIMITED = 1 << 20  # the console width for output that is not a terminal: never cut

# --------------------------------------------------------------------------- files


# --------------------------------------------------------------------------- output


def make_console(stderr: bool, color: str) -> tuple[Any, int | None]:
    """A rich console and the width tables fit into (None: not a terminal, never cut)."""
    from rich.console import Console

    class _Console(Console):
        def on_broken_pipe(self) -> None:
            # Nobody reads any more (`| head`): stop quietly, as a process killed by SIGPIPE would.
            quiet_stdout()
            raise SystemExit(EXIT_BROKEN_PIPE)

    stream = sys.stderr if stderr else sys.stdout
    try:
        tty = stream.isatty()
    except (AttributeError, ValueError):
        tty = False
    kwargs: dict[str, Any] = {"stderr": stderr, "highlight": False, "emoji": False, "markup": False}
    if color == "auto" and os.environ.get("NO_COLOR"):
        color = "never"  # no-color.org: set and not empty; rich alone would still write bold and dim
    if color == "never":
        kwargs["color_system"] = None  # no escape codes at all
    elif color == "always":
        kwargs["force_terminal"] = True
        kwargs["no_color"] = False  # asked for by name: NO_COLOR does not override it
    if not tty:
        kwargs["width"] = UNLIMITED
    console = _Console(**kwargs)
    return console, (console.width if tty else None)


class Runner:
    """Runs one command over many files: errors per file, rendering, exit status."""

    def __init__(self, as_json: bool, quiet: bool, color: str = "auto", fail_fast: bool = False,
                 batch: bool = False) -> None:
        self.as_json, self.quiet, self.fail_fast = as_json, quiet, fail_fast
        self.color = color
        # A batch run (--summary) says each warning once, after the run, with the files it
        # concerns: twelve step files skipping the same 49 layernorms make one line, not twelve.
        self.batch = batch
        self._held: dict[str, list[str]] = {}
        self._out: Any = None
        self._width: int | None = None
        self._err: Any = None
        self.failed: list[str] = []
        self.ok = 0
        self.checks_failed: list[str] = []
        warnings.showwarning = self._library_warning

    def _library_warning(self, message: Any, category: Any, filename: str, lineno: int, file: Any = None,
                         line: Any = None) -> None:
        if not self.quiet:
            self.say(f"Warning: {message}")

    # The consoles (and rich) only come when something is shown: -q and --json runs
    # start faster without them.
    @property
    def out(self) -> Any:
        if self._out is None:
            self._out, self._width = make_console(False, self.color)
        return self._out

    @property
    def width(self) -> int | None:
        _ = self.out
        return self._width

    @property
    def err(self) -> Any:
        if self._err is None:
            self._err, _ = make_console(True, self.color)
        return self._err

    def say(self, text: str) -> None:
        """One line on stderr, literally (no markup), never folded."""
        sys.stderr.write(safe(text) + "\n")
        sys.stderr.flush()

    def error(self, name: str, message: str) -> None:
        self.failed.append(name)
        self.say(f"Error: {message}")
        if self.as_json:
            self.emit({"schema": 1, "file": name, "output": None, "error": message})

    def warn(self, name: str, message: str, always: bool = False) -> None:
        if always or not self.quiet:
            if self.batch:
                self._held.setdefault(message, []).append(name)
                return
            self.say(f"Warning: {name}: {message}")

    def say_held(self) -> None:
        for message, names in self._held.items():
            where = names[0] if len(names) == 1 else f"{len(names)} files ({name_list(names, 1)})"
            self.say(f"Warning: {where}: {message}")
        self._held.clear()

    def note(self, name: str, warning: str) -> None:
        """A report's warning, options named by their flags; a failed check is shown even with -q."""
        failed = isinstance(warning, Note) and warning.kind is NoteKind.CHECK_FAILED
        self.warn(name, spelled(warning, flag), always=failed)

    def emit(self, data: dict[str, Any]) -> None:
        sys.stdout.write(json.dumps(data, allow_nan=False) + "\n")
        sys.stdout.flush()

    def expand(self, items: tuple[str, ...], recursive: bool,
               folders: Found | None = None) -> list[tuple[str, Path | None]]:
        from ..work.inputs import expand_files

        notes: list[tuple[str, Any]] = []
        found = list(expand_files(items, recursive, notes, folders))
        for folder, note in notes:
            self.note(folder, note)
        return found

    @contextmanager
    def progress(self, total: int) -> Iterator[Callable[[str], Callable[[int], None]] | None]:
        """A progress bar over the whole run (all files), or None when it would not help."""
        if self.quiet or self.as_json or total < PROGRESS_MIN_BYTES or not sys.stderr.isatty():
            yield None
            return
        from rich.progress import (
            BarColumn,
            DownloadColumn,
            Progress,
            TaskProgressColumn,
            TextColumn,
            TimeRemainingColumn,
            TransferSpeedColumn,
        )

        bar = Progress(TextColumn("{task.description}"), BarColumn(), TaskProgressColumn(), DownloadColumn(),
                       TransferSpeedColumn(), TimeRemainingColumn(), console=self.err, transient=True)
        with bar:
            task = bar.add_task("", total=total)

            def for_file(name: str) -> Callable[[int], None]:
                bar.update(task, description=safe(Path(name).name)[:40])
                return lambda n: bar.advance(task, n)

            yield for_file

    def attempt(self, name: str, work: Callable[[], Any]) -> Any:
        """Run ``work`` for one input; an error becomes one line and None."""
        try:
            return work()
        except BrokenPipeError:
            raise
        except TclipError as error:
            self.error(name, error.spelled(flag))
        except MemoryError:
            self.error(name, f"{name}: out of memory (try a smaller --memory or fewer --threads)")
        except OSError as error:
            where = error.filename if getattr(error, "filename", None) else name
            self.error(name, f"{where}: {error.strerror or error}")
        except Exception as error:  # a bug: still one line, the rest still run
            if os.environ.get("TCLIP_DEBUG"):
                raise
            self.error(name, f"{name}: internal error: {type(error).__name__}: {error}")
        return None

    def done(self, name: str, result: Any, show: Callable[[Any], None]) -> None:
        self.ok += 1
        for warning in getattr(result, "warnings", []):
            self.note(name, warning)
        if self.as_json:
            self.emit(result.to_json(flag))
        elif not self.quiet:
            show(result)

    def finish(self) -> int:
        self.say_held()
        if not self.as_json and not self.quiet and self.ok + len(self.failed) > 1:
            from .render.report import render_summary

            render_summary(self.ok, self.failed, self.out)
        if self.failed:
            return EXIT_FAILED
        return EXIT_CHECK_FAILED if self.checks_failed else 0


# --------------------------------------------------------------------------- clipping


def run_clip(mode: Any, *, files: tuple[str, ...], recursive: bool, output: Path | None, out_dir: Path | None,
             in_place: bool, force: bool, include: tuple[str, ...], exclude: tuple[str, ...], dry_run: bool,
             nonfinite: str, fail_fast: bool, as_json: bool, quiet: bool, color: str, threads: int | None,
             memory: int, drop_nonnumeric: bool, across_files: bool, dask_address: str | None,
             strict: bool = False, top: int | None = None, summary: bool = False) -> int:
    from ..work.clip import clip_set
    from ..work.companions import folder_companions
    from ..work.inputs import Found
    from ..work.options import ClipOptions
    from ..work.selection import Selection
    from ..work.sets import group_sets

    runner = Runner(as_json, quiet, color, fail_fast, batch=summary and not as_json)
    created = _make_out_dir(runner, out_dir, dry_run)
    if created is None:
        return runner.finish()
    options = ClipOptions(output=output, out_dir=out_dir, in_place=in_place, overwrite=force,
                          selection=Selection(include, exclude), nonfinite=nonfinite, strict=strict,
                          dry_run=dry_run, memory=memory, threads=threads or 0, drop_nonnumeric=drop_nonnumeric,
                          measure_after=as_json or not quiet)
    folders = Found()
    inputs = runner.expand(files, recursive, folders)
    sets = group_sets(inputs, across_files)
    # a folder's model.safetensors (save_pretrained's, a Trainer's) takes the folder's other files along
    copies = {} if out_dir is None else {
        weights: folder_companions(folder, out_dir, [p for _, p in inputs if p is not None])
        for weights, folder in folders.weights.items()}
    finished: list[Any] = []

    def show(report: Any) -> None:
        if summary:
            finished.append(report)  # one line each, after the run
            return
        from .render.report import render_file

        render_file(report, runner.out, width=runner.width, sort="name", top=top)  # natural order, as report

    def clip_one(tensor_set: Any, progress: Any) -> Any:
        return clip_set(tensor_set, mode, options, dask_address, progress,
                        copies.get(tensor_set.files[0]) if len(tensor_set.files) == 1 else None)

    try:
        if not dry_run and not in_place:
            # Every output of the run against every input of the run, before anything is written.
            try:
                _check_run_outputs(sets, options, copies)
            except TclipError as error:
                runner.error(str(error.path), error.spelled(flag))
                return runner.finish()
        with runner.progress(2 * _input_bytes(inputs)) as progress:
            _run_sets(runner, sets, lambda s: clip_one(s, progress), show, fail_fast)
    finally:
        for folder in created:  # innermost first; only empty ones
            try:
                folder.rmdir()
            except OSError:
                break
    if finished:
        from .render.batch import render_batch

        render_batch(finished, runner.out, runner.width)
    return runner.finish()


def _make_out_dir(runner: Runner, out_dir: Path | None, dry_run: bool) -> list[Path] | None:
    """The output folder, made: the folders this run makes (removed again if it writes nothing
    into them), innermost first; None when it cannot be made (said)."""
    created: list[Path] = []
    if out_dir is None or dry_run:
        return created
    folder = out_dir
    while not os.path.lexists(folder) and folder != folder.parent:  # False, not raised, for a name too long
        created.append(folder)
        folder = folder.parent
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        runner.error(str(out_dir), f"{out_dir}: cannot create the output directory ({error.strerror or error})")
        return None
    return created


def _input_bytes(inputs: list[tuple[str, Path | None]]) -> int:
    """The bytes of every file the inputs name (an index: its files), for the progress bar."""
    from ..formats.sharded import is_index, load_index

    total = 0
    for _, path in inputs:
        if path is None:
            continue
        try:
            members = load_index(path).files if is_index(path) else [path]
            total += sum(f.stat().st_size for f in members if f.exists())
        except (TclipError, OSError):
            pass  # reported when it runs
    return total


def _run_sets(runner: Runner, sets: list[tuple[str, Any]], work: Callable[[Any], Any],
              show: Callable[[Any], None], fail_fast: bool = False) -> None:
    """``work`` on each set (a file is a set of one), each report shown as it comes."""
    for name, item in sets:
        if item is None:
            runner.error(name, f"{name}: no tensor files match")
        else:
            report = runner.attempt(name, functools.partial(work, item))
            if report is not None:
                runner.done(name, report, show)
        if runner.failed and fail_fast:
            break


def _check_run_outputs(sets: list[tuple[str, Any]], options: Any, copies: dict[Path, Any]) -> None:
    """No output of the run is one of its inputs, and no two inputs share an output
    (see :func:`tclip.work.inputs.check_outputs`); inputs that cannot be read are left
    to fail on their own turn. ``copies``: a folder's other files copied with its weights."""
    from ..work.clip import planned_outputs
    from ..work.inputs import check_outputs
    from ..work.sets import alone

    outputs: dict[Path, Path] = {}
    every: list[Path] = []
    for _, item in sets:
        if item is None or alone(item) and not item.files[0].exists():
            continue
        try:
            part, members = planned_outputs(item, options)
        except (TclipError, OSError):
            continue
        for source, out in part.items():
            if source in outputs:  # one input given twice: its output is written twice, as before
                continue
            outputs[source] = out
        every += members
    for found in copies.values():
        for source, target in found.copies:
            outputs.setdefault(source, target)
            every.append(source)
    check_outputs(outputs, every)


# --------------------------------------------------------------------------- report


def run_report(*, files: tuple[str, ...], recursive: bool, order: str, axes: tuple[int, ...] | None,
               max_norm: float | None, sort: str, top: int | None, stats: bool, summary: bool, across_files: bool,
               include: tuple[str, ...], exclude: tuple[str, ...], as_json: bool, quiet: bool, color: str,
               threads: int | None, memory: int, quantity: str = "norms", max_drift: float | None = None,
               plot: str | None = None, heatmap: bool = False) -> int:
    from ..work.budget import Budget
    from ..work.gate import apply_gate
    from ..work.selection import Selection
    from ..work.sets import group_sets, report_set

    runner = Runner(as_json, quiet, color, batch=summary and not as_json)
    selection = Selection(include, exclude)
    inputs = runner.expand(files, recursive)
    moments = stats or (as_json and not summary)  # a summary's JSON has no moments
    reports = []

    def show(report: Any) -> None:
        from .render.report import render_file

        render_file(report, runner.out, width=runner.width, sort=sort, top=top, stats=stats)

    def measure(item: Any, progress: Any) -> Any:
        report = report_set(item, selection, order, axes, moments, Budget(memory, threads or 0), progress,
                            max_norm=max_norm)
        if max_norm is not None and apply_gate(report, max_norm, axes is not None, report.file, selection):
            runner.checks_failed.append(report.file)
        return report

    with runner.progress(_input_bytes(inputs)) as progress:
        for name, tensor_set in group_sets(inputs, across_files):
            if tensor_set is None:
                runner.error(name, f"{name}: no tensor files match")
                continue
            report = runner.attempt(name, functools.partial(measure, tensor_set, progress))
            if report is None:
                continue
            if summary:
                reports.append(report)
                runner.ok += 1
                for warning in report.warnings:
                    runner.note(name, warning)
            else:
                runner.done(name, report, show)
    if summary:
        from ..work.results import json_safe
        from ..work.summary import TOP_CHANGES, in_step_order, summary_json
        from .render.summary import render_across_files

        changes = top if top is not None else TOP_CHANGES
        if as_json:
            by_file = {r.file: r for r in reports}
            for entry in summary_json(reports, flag, sort=sort, top=changes):
                # every tensor's norm, as --of grads|drift give every value (the pictures' cells)
                entry["norms"] = json_safe([{"name": t.name, "norm": t.norm} for t in by_file[entry["file"]].tensors
                                            if t.norm is not None])
                runner.emit(entry)
        elif not quiet:
            render_across_files(reports, runner.out, runner.width, sort=sort, top=changes)
        if plot is not None or heatmap:
            from ..work.history import norms_grid
            from .pictures import command_line, show_grid

            if not show_grid(runner, norms_grid(in_step_order(reports, sort)), plot, heatmap, command_line()):
                return 1
        runner.say_held()
        return 1 if runner.failed else (EXIT_CHECK_FAILED if runner.checks_failed else 0)
    return runner.finish()



def run_info(*, files: tuple[str, ...], recursive: bool, sort: str, as_json: bool, quiet: bool, color: str) -> int:
    from ..work.sets import as_set, set_info

    def info_of(path: Path) -> Any:
        return set_info(as_set(path))

    runner = Runner(as_json, quiet, color)
    for name, path in runner.expand(files, recursive):
        if path is None:
            runner.error(name, f"{name}: no tensor files match")
            continue
        result = runner.attempt(name, functools.partial(info_of, path))
        if result is not None:
            from .render.info import render_info

            runner.done(name, result, lambda info: render_info(info, runner.out, width=runner.width, sort=sort))
    return runner.finish()


# --------------------------------------------------------------------------- diff


def run_diff(*, a: str, b: str, rtol: float, atol: float, mapping: tuple[str, ...], sort: str, top: int | None,
             include: tuple[str, ...], exclude: tuple[str, ...], as_json: bool, quiet: bool, color: str,
             threads: int | None, memory: int, tensors_only: bool = False) -> int:
    from ..work.diff import diff_files
    from ..work.mapping import parse_mapping
    from ..work.inputs import diff_input
    from ..work.selection import Selection
    from .render.diff import render_diff

    runner = Runner(as_json, quiet, color)
    try:
        renames = parse_mapping(mapping)
    except ValueError as error:
        import click

        raise click.BadParameter(str(error), param_hint="'--map'") from None
    name = f"{a} vs {b}"
    notes: list[tuple[str, Any]] = []

    def sides() -> tuple[str, str]:
        chosen = diff_input(a, notes), diff_input(b, notes)
        for folder, note in notes:
            runner.note(folder, note)
        return chosen

    result = runner.attempt(name, lambda: diff_files(*sides(), rtol=rtol, atol=atol,
                                                     mapping=renames, selection=Selection(include, exclude),
                                                     memory=memory, threads=threads or 0,
                                                     tensors_only=tensors_only))
    if result is None:
        return EXIT_FAILED
    for warning in result.warnings:
        runner.note(name, warning)
    if as_json:
        runner.emit(result.to_json(flag))
    elif not quiet:
        render_diff(result, runner.out, runner.width, sort=sort, top=top)
    if not result.same:
        if quiet and not as_json:
            what = "differ" if result.differs else "were not all compared"
            runner.say(f"Warning: {safe(a)} and {safe(b)} {what}: {result.summary_line(flag)}")
        return EXIT_CHECK_FAILED
    return 0
