"""The ``tclip`` command line: parse, call one library function per file, render.

Every command is a thin client of :mod:`tclip.pipeline`; errors from the library
(:class:`~tclip.errors.TclipError`) become one ``Error: <file>: <what>`` line on
stderr, and the other files still run.
"""

from __future__ import annotations

import glob
import json
import math
import os
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import click
from rich.console import Console
from rich.progress import (
    BarColumn,
    DownloadColumn,
    Progress,
    TextColumn,
    TransferSpeedColumn,
)

from ._version import __version__
from .errors import TclipError
from .formats import SUFFIXES
from .pipeline import ClipOptions, Selection, clip_file, file_info, report_file
from .plan import AverageNormClip, GlobalNormClip, Mode, NormClip, ValueClip
from .render import render_file, render_info, render_summary
from .report import FileReport

EXIT_FAILED = 1
EXIT_CHECK_FAILED = 3
# Files smaller than this take well under a second: no progress bar flashing by.
PROGRESS_MIN_BYTES = 64 << 20


# --------------------------------------------------------------------------- parameter types


class FiniteFloat(click.ParamType):
    """A float that is not NaN; ``positive`` also requires > 0 (``inf`` allowed)."""

    name = "float"

    def __init__(self, positive: bool = False, allow_inf: bool = True) -> None:
        self.positive = positive
        self.allow_inf = allow_inf

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> float:
        if isinstance(value, float):
            number = value
        else:
            try:
                number = float(value)
            except (TypeError, ValueError):
                self.fail(f"{value!r} is not a number", param, ctx)
        if math.isnan(number):
            self.fail("NaN is not allowed", param, ctx)
        if math.isinf(number) and not self.allow_inf:
            self.fail("must be finite", param, ctx)
        if self.positive and number <= 0:
            self.fail(f"must be > 0, got {value}", param, ctx)
        return number


class AxesType(click.ParamType):
    """Axes as comma-separated integers: ``1``, ``-1``, ``0,1``."""

    name = "axes"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> tuple[int, ...]:
        if isinstance(value, tuple):
            return value
        parts = [p.strip() for p in str(value).split(",")]
        try:
            axes = tuple(int(p) for p in parts)
        except ValueError:
            self.fail(f"{value!r} is not a comma-separated list of integers (e.g. 1, -1, 0,1)", param, ctx)
        if len(set(axes)) != len(axes):
            self.fail(f"{value!r} repeats an axis", param, ctx)
        return axes


POSITIVE = FiniteFloat(positive=True)
BOUND = FiniteFloat()  # -inf/inf allowed: a one-sided clip


# --------------------------------------------------------------------------- shared options


def file_arguments(f: Callable) -> Callable:
    f = click.option("-r", "--recursive", is_flag=True, help="Descend into directories (and ** in globs).")(f)
    return click.argument("files", nargs=-1, required=True, metavar="FILE...")(f)


def output_options(f: Callable) -> Callable:
    for decorator in reversed([
        click.option("-o", "--output", type=click.Path(dir_okay=False, path_type=Path),
                     help="Output file (one input only); its suffix picks the format, so it also converts."),
        click.option("--out-dir", type=click.Path(file_okay=False, path_type=Path),
                     help="Write outputs into this directory, under the inputs' names."),
        click.option("--in-place", is_flag=True, help="Replace each input atomically."),
        click.option("--force", is_flag=True, help="Replace an existing output."),
        click.option("--include", multiple=True, metavar="GLOB",
                     help="Clip only tensors whose names match (repeatable)."),
        click.option("--exclude", multiple=True, metavar="GLOB", help="Leave tensors whose names match (repeatable)."),
        click.option("--dry-run", is_flag=True, help="Compute and report, write nothing."),
        click.option("--nonfinite", type=click.Choice(["error", "propagate"]), default="error", show_default=True,
                     help="NaN/Inf in selected tensors: refuse the file, or clip as TensorFlow does."),
        click.option("--strict", is_flag=True, help="Tensors whose rank cannot take --axes are an error, not skipped."),
        click.option("--fail-fast", is_flag=True, help="Stop at the first file that fails."),
    ]):
        f = decorator(f)
    return f


def display_options(f: Callable) -> Callable:
    f = click.option("-q", "--quiet", is_flag=True, help="Print errors only.")(f)
    return click.option("--json", "as_json", is_flag=True, help="JSON Lines on stdout, one object per file.")(f)


# --------------------------------------------------------------------------- files


def _is_tensor_file(path: Path) -> bool:
    return path.suffix.lower() in SUFFIXES and not path.stem.endswith(".clipped")


def expand_files(items: tuple[str, ...], recursive: bool) -> Iterator[tuple[str, Path | None]]:
    """(display name, path) per input; path None when the item matched nothing."""
    for item in items:
        path = Path(item)
        if path.is_dir():
            found = sorted(path.rglob("*") if recursive else path.iterdir())
            files = [p for p in found if p.is_file() and _is_tensor_file(p)]
            if not files:
                yield item, None
            for p in files:
                yield str(p), p
        elif path.exists() or not glob.has_magic(item):
            yield item, path
        else:
            matches = sorted(glob.glob(item, recursive=recursive))
            files = [Path(m) for m in matches if Path(m).is_file() and _is_tensor_file(Path(m))]
            if not files:
                yield item, None
            for p in files:
                yield str(p), p


class Runner:
    """Runs one command over many files: errors per file, rendering, exit status."""

    def __init__(self, as_json: bool, quiet: bool, fail_fast: bool = False) -> None:
        self.as_json, self.quiet, self.fail_fast = as_json, quiet, fail_fast
        self.out = Console(highlight=False)
        self.err = Console(stderr=True, highlight=False)
        self.failed: list[str] = []
        self.ok = 0

    def progress(self) -> Progress | None:
        if self.quiet or self.as_json or not self.err.is_terminal:
            return None
        return Progress(TextColumn("{task.description}"), BarColumn(), DownloadColumn(), TransferSpeedColumn(),
                        console=self.err, transient=True)

    def error(self, name: str, message: str) -> None:
        self.failed.append(name)
        self.err.print(f"Error: {message}", markup=False, highlight=False, soft_wrap=True)
        if self.as_json:
            self.emit({"schema": 1, "file": name, "output": None, "error": message})

    def emit(self, data: dict[str, Any]) -> None:
        click.echo(json.dumps(data, allow_nan=False))

    def run(self, items: tuple[str, ...], recursive: bool, work: Callable[[Path, Any], Any],
            show: Callable[[Any], None]) -> None:
        for name, path in expand_files(items, recursive):
            if path is None:
                self.error(name, f"{name}: no tensor files match")
            else:
                try:
                    result = self._with_progress(path, work)
                except TclipError as error:
                    self.error(name, str(error))
                except (OSError, MemoryError) as error:
                    self.error(name, f"{name}: {getattr(error, 'strerror', None) or error}")
                except Exception as error:  # a bug: still one line, the rest still run
                    if os.environ.get("TCLIP_DEBUG"):
                        raise
                    self.error(name, f"{name}: internal error: {type(error).__name__}: {error}")
                else:
                    self.ok += 1
                    for warning in getattr(result, "warnings", []):
                        if not self.quiet:
                            self.err.print(f"Warning: {name}: {warning}", markup=False, soft_wrap=True)
                    if self.as_json:
                        self.emit(result.to_json())
                    elif not self.quiet:
                        show(result)
            if self.failed and self.fail_fast:
                break
        if not self.as_json and not self.quiet:
            render_summary(self.ok, self.failed, self.out)

    def _with_progress(self, path: Path, work: Callable[[Path, Any], Any]) -> Any:
        progress = self.progress()
        try:
            small = path.stat().st_size < PROGRESS_MIN_BYTES
        except OSError:
            small = True  # the work itself reports the error
        if progress is None or small:
            return work(path, None)
        with progress:
            task = progress.add_task(path.name, total=None)
            return work(path, lambda n: progress.advance(task, n))

    def exit_code(self) -> int:
        return EXIT_FAILED if self.failed else 0


# --------------------------------------------------------------------------- commands


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, "--version", prog_name="tclip")
def cli() -> None:
    """Clip tensors saved on disk (.npy, .npz, safetensors, HDF5) as TensorFlow would.

    Each clipping command writes NAME.clipped.EXT beside its input (see -o,
    --out-dir, --in-place) and prints a norm report; `report` and `info` only read.

    \b
    Example:
        tclip norm --clip 5 --axes 1 grads.npz
        tclip global --clip 1 step_41200.safetensors
        tclip report --json runs/*.safetensors
    """


def _clip_command(ctx: click.Context, mode: Mode, files: tuple[str, ...], recursive: bool, output: Path | None,
                  out_dir: Path | None, in_place: bool, force: bool, include: tuple[str, ...],
                  exclude: tuple[str, ...], dry_run: bool, nonfinite: str, strict: bool, fail_fast: bool,
                  as_json: bool, quiet: bool) -> None:
    if output is not None and (len(files) > 1 or any(Path(f).is_dir() or glob.has_magic(f) and not Path(f).exists()
                                                     for f in files)):
        raise click.UsageError("-o/--output takes exactly one input file; use --out-dir for several")
    if in_place and (output is not None or out_dir is not None):
        raise click.UsageError("--in-place cannot be combined with -o/--output or --out-dir")
    if output is not None and out_dir is not None:
        raise click.UsageError("-o/--output and --out-dir cannot be combined")
    if output is not None and output.suffix.lower() not in SUFFIXES:
        raise click.BadParameter("the suffix must be .npy, .npz, .safetensors, .h5 or .hdf5",
                                 param_hint="'-o/--output'")
    if out_dir is not None and not out_dir.is_dir():
        raise click.BadParameter(f"directory '{out_dir}' does not exist", param_hint="'--out-dir'")
    options = ClipOptions(output=output, out_dir=out_dir, in_place=in_place, overwrite=force,
                          selection=Selection(include, exclude), nonfinite=nonfinite, strict=strict, dry_run=dry_run)
    runner = Runner(as_json, quiet, fail_fast)

    def show(report: FileReport) -> None:
        render_file(report, runner.out)

    runner.run(files, recursive, lambda path, progress: clip_file(path, mode, options, progress), show)
    ctx.exit(runner.exit_code())


@cli.command("value")
@click.option("--min", "minimum", type=BOUND, required=True, help="Lower bound (clip_value_min); -inf for none.")
@click.option("--max", "maximum", type=BOUND, required=True, help="Upper bound (clip_value_max); inf for none.")
@output_options
@display_options
@file_arguments
@click.pass_context
def value_command(ctx: click.Context, minimum: float, maximum: float, **kwargs: Any) -> None:
    """Clip every element to [MIN, MAX] (tf.clip_by_value).

    Integer tensors are left as they are; the report counts changed elements.

    \b
    Example:
        tclip value --min -1 --max 1 grads.safetensors
    """
    if minimum > maximum:
        raise click.BadParameter(f"--min {minimum:g} is greater than --max {maximum:g}", param_hint="'--min'")
    _clip_command(ctx, ValueClip(minimum, maximum), **kwargs)


@cli.command("norm")
@click.option("--clip", "clip_norm", type=POSITIVE, required=True, help="Largest L2 norm allowed (clip_norm > 0).")
@click.option("--axes", type=AxesType(), default=None,
              help="Clip each slice along these axes (e.g. 1, -1, 0,1); default: the whole tensor.")
@output_options
@display_options
@file_arguments
@click.pass_context
def norm_command(ctx: click.Context, clip_norm: float, axes: tuple[int, ...] | None, **kwargs: Any) -> None:
    """Clip each tensor to an L2 norm of at most CLIP (tf.clip_by_norm).

    With --axes, each slice along those axes is clipped on its own (rows of a
    2-D weight with --axes 1); tensors whose rank has no such axis (1-D biases)
    are left unchanged and reported as skipped, unless --strict.

    \b
    Example:
        tclip norm --clip 5 --axes 1 grads.npz
    """
    _clip_command(ctx, NormClip(clip_norm, axes), **kwargs)


@cli.command("average")
@click.option("--clip", "clip_norm", type=POSITIVE, required=True,
              help="Largest L2 norm per element allowed (norm / size).")
@output_options
@display_options
@file_arguments
@click.pass_context
def average_command(ctx: click.Context, clip_norm: float, **kwargs: Any) -> None:
    """Clip each tensor so that its L2 norm divided by its size is at most CLIP (tf.clip_by_average_norm).

    \b
    Example:
        tclip average --clip 0.01 grads.h5
    """
    _clip_command(ctx, AverageNormClip(clip_norm), **kwargs)


@cli.command("global")
@click.option("--clip", "clip_norm", type=POSITIVE, required=True, help="Largest global L2 norm allowed.")
@click.option("--use-norm", type=FiniteFloat(positive=True), default=None,
              help="Use this global norm instead of computing it.")
@output_options
@display_options
@file_arguments
@click.pass_context
def global_command(ctx: click.Context, clip_norm: float, use_norm: float | None, **kwargs: Any) -> None:
    """Scale all selected tensors of a file by one factor so that their global norm is at most CLIP.

    This is tf.clip_by_global_norm (and PyTorch's clip_grad_norm_, optax's
    clip_by_global_norm) over the file's floating tensors; each file has its own
    global norm.

    \b
    Example:
        tclip global --clip 1 step_41200.safetensors
    """
    _clip_command(ctx, GlobalNormClip(clip_norm, use_norm), **kwargs)


@cli.command("report")
@click.option("--ord", "order", type=click.Choice(["2", "1", "inf"]), default="2", show_default=True,
              help="The norm shown: L2, L1 or the largest |x|.")
@click.option("--axes", type=AxesType(), default=None, help="Also report the largest slice norm along these axes.")
@click.option("--max-norm", type=FiniteFloat(positive=True), default=None,
              help="Exit 3 if the global norm (with --axes: any slice norm) exceeds this, or NaN/Inf is found.")
@click.option("--include", multiple=True, metavar="GLOB", help="Report only tensors whose names match.")
@click.option("--exclude", multiple=True, metavar="GLOB", help="Leave out tensors whose names match.")
@display_options
@file_arguments
@click.pass_context
def report_command(ctx: click.Context, order: str, axes: tuple[int, ...] | None, max_norm: float | None,
                   include: tuple[str, ...], exclude: tuple[str, ...], files: tuple[str, ...], recursive: bool,
                   as_json: bool, quiet: bool) -> None:
    """Report norms and statistics of every tensor; writes nothing.

    \b
    Example:
        tclip report --max-norm 100 grads.safetensors || echo "exploded"
    """
    runner = Runner(as_json, quiet)
    breaches: list[str] = []

    def work(path: Path, progress: Any) -> FileReport:
        report = report_file(path, axes=axes, ord=order, selection=Selection(include, exclude), progress=progress)
        if max_norm is not None:
            report.params["max_norm"] = max_norm
            reason = _check(report, max_norm, axes is not None)
            if reason:
                breaches.append(path.name)
                report.warnings.append(f"check failed: {reason}")
        return report

    runner.run(files, recursive, work, lambda report: render_file(report, runner.out))
    code = runner.exit_code()
    if code == 0 and breaches:
        code = EXIT_CHECK_FAILED
    ctx.exit(code)


def _check(report: FileReport, max_norm: float, per_slice: bool) -> str | None:
    bad = report.nonfinite_tensors
    if bad:
        return f"NaN/Inf in {', '.join(bad)}"
    if per_slice:
        over = [t.name for t in report.tensors if t.max_slice_norm is not None and t.max_slice_norm > max_norm]
        if over:
            return f"slice norms above {max_norm:g} in {', '.join(over)}"
    elif report.global_norm is not None and report.global_norm > max_norm:
        return f"global norm {report.global_norm:.6g} is above {max_norm:g}"
    return None


@cli.command("info")
@display_options
@file_arguments
@click.pass_context
def info_command(ctx: click.Context, files: tuple[str, ...], recursive: bool, as_json: bool, quiet: bool) -> None:
    """Show names, shapes, dtypes, sizes and metadata from the header alone (no tensor data is read).

    \b
    Example:
        tclip info model.safetensors
    """
    runner = Runner(as_json, quiet)
    runner.run(files, recursive, lambda path, progress: file_info(path), lambda info: render_info(info, runner.out))
    ctx.exit(runner.exit_code())


def main() -> None:
    """Console entry point."""
    cli(prog_name="tclip")


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
