"""The command line's parameter types and the options many commands share, written once.

Validation lives in the types (click turns ``self.fail`` into a usage error, exit
status 2), so command bodies get valid values."""

from __future__ import annotations

import functools
import math
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any, overload

import click


class FiniteFloat(click.ParamType):
    """A float that is not NaN; ``positive`` also requires > 0 (``inf`` allowed), ``nonnegative`` >= 0."""

    name = "float"

    def __init__(self, positive: bool = False, allow_inf: bool = True, nonnegative: bool = False) -> None:
        self.positive = positive
        self.allow_inf = allow_inf
        self.nonnegative = nonnegative

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
        if self.nonnegative and number < 0:
            self.fail(f"must be >= 0, got {value}", param, ctx)
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


class SizeType(click.ParamType):
    """A byte size: ``256M``, ``1G``, ``512MiB``, ``1.5GB``, or a plain number of bytes."""

    name = "size"
    _UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> int:
        if isinstance(value, int):
            return value
        match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([kKmMgGtT]?)(i?[bB])?\s*", str(value))
        if not match:
            self.fail(f"{value!r} is not a size (e.g. 256M, 1G)", param, ctx)
        size = int(float(match[1]) * self._UNITS[match[2].lower()])
        if size < 16 << 20:
            self.fail(f"{value!r} is below the minimum of 16M", param, ctx)
        return size


POSITIVE = FiniteFloat(positive=True)


BOUND = FiniteFloat()  # -inf/inf allowed: a one-sided clip


TOLERANCE = FiniteFloat(allow_inf=False, nonnegative=True)  # diff's rtol/atol, as numpy.isclose takes them


FILES = click.Path(dir_okay=True, file_okay=True)  # completes file names; globs are expanded by tclip


def file_arguments(f: Callable) -> Callable:
    f = click.option("-r", "--recursive", is_flag=True, help="Descend into directories (and ** in globs).")(f)
    return click.argument("files", nargs=-1, required=True, metavar="FILE...", type=FILES)(f)


# tclip.work.budget.MAX_THREADS, written out: parsing options imports nothing heavy.
MAX_THREADS = 1024


def budget_options(f: Callable) -> Callable:
    f = click.option("--memory", type=SizeType(), default="256M", show_default=True,
                     help="Working-set budget: block buffers and per-slice statistics (e.g. 64M, 2G).")(f)
    return click.option("--threads", type=click.IntRange(min=1, max=MAX_THREADS), default=None,
                        help=f"Threads for statistics and scaling, 1 to {MAX_THREADS} "
                             "[default: the machine's cores].")(f)


@overload
def selection_options(f: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]: ...
@overload
def selection_options(f: Callable[..., Any], verb: str = "Clip") -> Callable[..., Any]: ...
def selection_options(f: Callable[..., Any] | str, verb: str = "Clip") -> Callable[..., Any]:
    if isinstance(f, str):  # @selection_options("Report"): the verb for the help text
        return functools.partial(selection_options, verb=f)
    f = click.option("--exclude", multiple=True, metavar="GLOB",
                     help="Leave tensors whose names match (repeatable).")(f)
    return click.option("--include", multiple=True, metavar="GLOB",
                        help=f"{verb} only tensors whose names match (repeatable; a leading / is ignored).")(f)


def output_options(f: Callable) -> Callable:
    for decorator in reversed([
        click.option("-o", "--output", type=click.Path(dir_okay=False, path_type=Path),
                     help="Output file (one input only); its suffix picks the format, so it also converts."),
        click.option("--out-dir", type=click.Path(file_okay=False, path_type=Path),
                     help="Write outputs into this directory (created if missing), under the inputs' names."),
        click.option("--in-place", is_flag=True, help="Replace each input atomically."),
        click.option("--force", is_flag=True, help="Replace an existing output."),
        click.option("--dry-run", is_flag=True, help="Compute and report, write nothing."),
        click.option("--nonfinite", type=click.Choice(["error", "propagate"]), default="error", show_default=True,
                     help="NaN/Inf in selected tensors: refuse the file, or clip as TensorFlow does."),
        click.option("--drop-nonnumeric", is_flag=True,
                     help="Converting: drop what the output format cannot hold (strings, metadata) with a warning."),
        click.option("--across-files", is_flag=True,
                     help="Treat all FILEs as one tensor set (one global norm); names must not repeat."),
        click.option("--dask", "dask_address", metavar="ADDRESS", default=None,
                     help="Run the per-file tasks on a dask.distributed scheduler (tcp://host:8786)."),
        click.option("--fail-fast", is_flag=True, help="Stop at the first file that fails."),
        click.option("--top", type=click.IntRange(min=1), default=None,
                     help="Show only the K tensors of largest norm in each table (as report does)."),
        click.option("--summary", is_flag=True,
                     help="One line per file (global norm before and after, clipped, skipped, output) "
                          "instead of a table per file: for batch runs."),
    ]):
        f = decorator(f)
    return selection_options(budget_options(f))


def display_options(f: Callable) -> Callable:
    f = click.option("--color", type=click.Choice(["auto", "always", "never"]), default="auto", show_default=True,
                     help="Colour in tables.")(f)
    f = click.option("-q", "--quiet", is_flag=True, help="Print errors and failed checks only.")(f)
    return click.option("--json", "as_json", is_flag=True, help="JSON Lines on stdout, one object per file.")(f)
