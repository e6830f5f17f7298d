"""The ``tclip`` commands: parse, call one library function per file, render.

Every command is a thin client of :mod:`tclip.work` (through :mod:`tclip.cli.runner`);
errors from the library
(:class:`~tclip.errors.TclipError`) become one ``Error: <file>: <what>`` line on
stderr, and the other files still run.

Only click is imported at start-up: NumPy, rich and the format libraries are
imported inside the commands, so ``--help``, ``--version`` and shell completion
stay fast.
"""

from __future__ import annotations

import glob
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import click

from .._version import __version__
from .params import (
    BOUND,
    FILES,
    POSITIVE,
    TOLERANCE,
    AxesType,
    FiniteFloat,
    display_options,
    budget_options,
    file_arguments,
    output_options,
    selection_options,
)

# --------------------------------------------------------------------------- commands


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, "-V", "--version", prog_name="tclip")
def cli() -> None:
    """Clip, inspect and compare tensors saved on disk (.npy, .npz, safetensors, HDF5, PyTorch, GGUF).

    Each clipping command writes NAME.clipped.EXT beside its input (see -o,
    --out-dir, --in-place) and prints a norm report; `report`, `info` and
    `diff` only read. A FILE may be a path, a quoted glob, a directory, or a
    sharded checkpoint's index (model.safetensors.index.json, pytorch_model.bin.index.json)
    or any file of a GGUF split set (model-00001-of-00003.gguf).

    \b
    Example:
        tclip norm --clip 5 --axes 1 grads.npz
        tclip global --clip 1 model.safetensors.index.json --out-dir clipped/
        tclip report --summary 'run/step_*.safetensors'
        tclip diff before.npz after.safetensors
    """


def _clip(ctx: click.Context, mode_factory: Callable[[], Any], kwargs: dict[str, Any]) -> None:
    from ..formats.limits import names_within
    from .runner import run_clip

    with names_within(kwargs["memory"]):  # what a file's names may take, as its tensors
        ctx.exit(run_clip(mode_factory(), **kwargs))


def _check_outputs(output: Path | None, out_dir: Path | None, in_place: bool, files: tuple[str, ...]) -> None:
    if output is not None and (len(files) > 1 or any(os.path.isdir(f) or (glob.has_magic(f) and not os.path.exists(f))
                                                     or f.endswith(".index.json") for f in files)):
        raise click.UsageError("-o/--output takes exactly one input file; use --out-dir for several")
    if in_place and (output is not None or out_dir is not None):
        raise click.UsageError("--in-place cannot be combined with -o/--output or --out-dir")
    if output is not None and out_dir is not None:
        raise click.UsageError("-o/--output and --out-dir cannot be combined")
    if output is not None:
        from ..formats.registry import (  # the formats know their suffixes; NumPy only now
            suffix_list,
            suffixes,
        )

        from ..formats.dcp import METADATA_NAME

        # DIR/.metadata: a DCP folder (docs/dcp.md), written only as a rewrite of one, which the writer checks
        if output.suffix.lower() not in suffixes() and output.name != METADATA_NAME:
            raise click.BadParameter(f"the suffix must be {suffix_list()}", param_hint="'-o/--output'")
    # os.path's tests, not Path's: they answer False for a name too long (ENAMETOOLONG) where
    # Path.exists raises; the run then names the problem in one line.
    if out_dir is not None and os.path.exists(out_dir) and not os.path.isdir(out_dir):
        raise click.BadParameter(f"'{out_dir}' exists and is not a directory", param_hint="'--out-dir'")


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
    _check_outputs(kwargs["output"], kwargs["out_dir"], kwargs["in_place"], kwargs["files"])

    def mode() -> Any:
        from ..core.modes import ValueClip

        return ValueClip(minimum, maximum)

    _clip(ctx, mode, kwargs)


@cli.command("norm")
@click.option("--clip", "clip_norm", type=POSITIVE, required=True, help="Largest L2 norm allowed (clip_norm > 0).")
@click.option("--axes", type=AxesType(), default=None,
              help="Clip each slice along these axes (e.g. 1, -1, 0,1); default: the whole tensor.")
@click.option("--strict", is_flag=True, help="Tensors whose rank cannot take --axes are an error, not skipped.")
@output_options
@display_options
@file_arguments
@click.pass_context
def norm_command(ctx: click.Context, clip_norm: float, axes: tuple[int, ...] | None, strict: bool,
                 **kwargs: Any) -> None:
    """Clip each tensor to an L2 norm of at most CLIP (tf.clip_by_norm).

    With --axes, each slice along those axes is clipped on its own (rows of a
    2-D weight with --axes 1); tensors whose rank has no such axis (1-D biases)
    are left unchanged and reported as skipped, unless --strict.

    \b
    Example:
        tclip norm --clip 5 --axes 1 grads.npz
    """
    _check_outputs(kwargs["output"], kwargs["out_dir"], kwargs["in_place"], kwargs["files"])

    def mode() -> Any:
        from ..core.modes import NormClip

        return NormClip(clip_norm, axes)

    _clip(ctx, mode, {**kwargs, "strict": strict})


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
    _check_outputs(kwargs["output"], kwargs["out_dir"], kwargs["in_place"], kwargs["files"])

    def mode() -> Any:
        from ..core.modes import AverageNormClip

        return AverageNormClip(clip_norm)

    _clip(ctx, mode, kwargs)


@cli.command("global")
@click.option("--clip", "clip_norm", type=POSITIVE, required=True, help="Largest global L2 norm allowed.")
@click.option("--use-norm", type=FiniteFloat(positive=True), default=None,
              help="Use this global norm instead of computing it.")
@output_options
@display_options
@file_arguments
@click.pass_context
def global_command(ctx: click.Context, clip_norm: float, use_norm: float | None, **kwargs: Any) -> None:
    """Scale all selected tensors by one factor so that their global norm is at most CLIP.

    This is tf.clip_by_global_norm (PyTorch's clip_grad_norm_, optax's
    clip_by_global_norm) over the floating tensors of one file -- or of a whole
    tensor set: a sharded checkpoint's index, or FILEs with --across-files.

    \b
    Example:
        tclip global --clip 1 step_41200.safetensors
        tclip global --clip 1 model.safetensors.index.json --out-dir clipped/
    """
    _check_outputs(kwargs["output"], kwargs["out_dir"], kwargs["in_place"], kwargs["files"])

    def mode() -> Any:
        from ..core.modes import GlobalNormClip

        return GlobalNormClip(clip_norm, use_norm)

    _clip(ctx, mode, kwargs)


@cli.command("report")
@click.option("--ord", "order", type=click.Choice(["2", "1", "inf"]), default="2", show_default=True,
              help="The norm shown: L2, L1 or the largest |x|.")
@click.option("--axes", type=AxesType(), default=None,
              help="Also report slice norms along these axes: largest, smallest, near-zero, worst by index.")
@click.option("--max-norm", type=FiniteFloat(positive=True), default=None,
              help="Exit 3 if the global norm (with --axes: any slice norm, or the whole norm of a tensor whose "
                   "rank cannot take them) exceeds this, any NaN/Inf is found, or a selected tensor cannot be read.")
@click.option("--sort", type=click.Choice(["name", "norm", "order"]), default="name", show_default=True,
              help="Rows by name (natural order: layers.2 before layers.10), largest norm first, or file order "
                   "(with --summary: files by path, by global norm, or as given).")
@click.option("--top", type=click.IntRange(min=1), default=None,
              help="Only the K largest norms (with --summary: the K largest changes; default 10).")
@click.option("--stats", is_flag=True, help="Also min, max, mean, std, zeros and a log2 |x| histogram.")
@click.option("--summary", is_flag=True,
              help="One row per file (natural order), then the tensors that changed most between files.")
@click.option("--of", "quantity", type=click.Choice(["norms", "grads", "drift"]), default="norms",
              show_default=True,
              help="With --summary: the tensors' own norms, gradient norms from Adam optimizer state, or the "
                   "relative change of each tensor between consecutive files.")
@click.option("--max-drift", type=FiniteFloat(positive=True), default=None,
              help="With --summary --of drift: exit 3 if a tensor's relative change between two files exceeds this.")
@click.option("--plot", type=click.Path(dir_okay=False, writable=True), default=None,
              help="With --summary: write a tensors x files picture, by suffix .svg, .html or .png.")
@click.option("--heatmap", is_flag=True, help="With --summary: draw the tensors x files grid in the terminal.")
@click.option("--across-files", is_flag=True, help="Treat all FILEs as one tensor set (one global norm).")
@budget_options
@selection_options("Include")
@display_options
@file_arguments
@click.pass_context
def report_command(ctx: click.Context, **kwargs: Any) -> None:
    """Report norms and statistics of every tensor; writes nothing.

    --max-norm turns it into a gate: exit status 3 when a limit is exceeded
    (by more than 2 ulps of the tensor's dtype), a NaN/Inf is found, or a
    selected tensor could not be measured (--exclude it to gate the rest).

    \b
    Example:
        tclip report --max-norm 100 grads.safetensors || echo "exploded"
        tclip report --summary 'run/step_*.safetensors'
        tclip report --summary --of grads --plot grads.svg 'run/checkpoint-*'
    """
    if kwargs["summary"] and kwargs["stats"]:
        # One row per file has no room for per-tensor statistics: say so, never ignore it.
        raise click.UsageError("--stats shows per-tensor statistics and --summary one row per file; use one of them")
    _check_history_options(kwargs)
    from ..formats.limits import names_within

    with names_within(kwargs["memory"]):
        if kwargs["summary"] and kwargs["quantity"] != "norms":
            from .history import run_history
            from .pictures import command_line

            history = {k: kwargs[k] for k in ("files", "recursive", "quantity", "sort", "top", "include", "exclude",
                                              "as_json", "quiet", "color", "threads", "memory", "max_drift", "plot",
                                              "heatmap")}
            ctx.exit(run_history(**history, command=command_line()))
        from .runner import run_report

        ctx.exit(run_report(**kwargs))


def _check_history_options(kwargs: dict[str, Any]) -> None:
    """--of, --plot, --heatmap and --max-drift belong to --summary: say so, never ignore them."""
    if not kwargs["summary"]:
        for name, given in (("--of", kwargs["quantity"] != "norms"), ("--plot", kwargs["plot"] is not None),
                            ("--heatmap", kwargs["heatmap"]), ("--max-drift", kwargs["max_drift"] is not None)):
            if given:
                raise click.UsageError(f"{name} works with --summary (one picture of a run's files)")
    if kwargs["max_drift"] is not None and kwargs["quantity"] != "drift":
        raise click.UsageError("--max-drift needs --of drift")
    if kwargs["quantity"] != "norms":
        # these shape the tensors' own norms, which --of grads|drift do not show
        for name, given in (("--max-norm", kwargs["max_norm"] is not None), ("--axes", kwargs["axes"] is not None),
                            ("--ord", kwargs["order"] != "2"), ("--across-files", kwargs["across_files"]),
                            ("--sort norm", kwargs["sort"] == "norm")):
            if given:
                raise click.UsageError(f"{name} works with --of norms, not --of {kwargs['quantity']}")
    plot = kwargs["plot"]
    if plot is not None and not plot.lower().endswith((".svg", ".html", ".png")):
        raise click.UsageError(f"--plot {plot}: the picture's format is chosen by its suffix: .svg, .html or .png")


@cli.command("info")
@click.option("--sort", type=click.Choice(["name", "order"]), default="name", show_default=True,
              help="Rows by name (natural order: layers.2 before layers.10) or file order.")
@display_options
@file_arguments
@click.pass_context
def info_command(ctx: click.Context, **kwargs: Any) -> None:
    """Show names, shapes, dtypes, sizes and metadata from the header alone (no tensor data is read).

    \b
    Example:
        tclip info model.safetensors
    """
    from .runner import run_info

    ctx.exit(run_info(**kwargs))


@cli.command("diff")
@click.argument("a", type=FILES, metavar="A")
@click.argument("b", type=FILES, metavar="B")
@click.option("--rtol", type=TOLERANCE, default=0.0, show_default=True,
              help="Relative tolerance: elements differ when |a-b| > atol + rtol*|b| (numpy.isclose's rule).")
@click.option("--atol", type=TOLERANCE, default=0.0, show_default=True,
              help="Absolute tolerance (see --rtol). The defaults mean bit-for-bit equal values.")
@click.option("--map", "mapping", multiple=True, metavar="OLD=NEW",
              help="Rename A's tensors before matching: a name or a glob with * (repeatable).")
@click.option("--sort", type=click.Choice(["diff", "name", "order"]), default="diff", show_default=True,
              help="Rows by relative difference (largest first), by name, or in A's order.")
@click.option("--top", type=click.IntRange(min=1), default=None, help="Only the K largest differences.")
@click.option("--tensors-only", is_flag=True,
              help="Metadata and attribute differences are listed but do not count: the verdict is the tensors'.")
@budget_options
@selection_options("Compare")
@display_options
@click.pass_context
def diff_command(ctx: click.Context, **kwargs: Any) -> None:
    """Compare two tensor files (any formats) tensor by tensor; writes nothing.

    Per tensor: ||a-b||, ||a-b||/||a||, max|a-b|, cosine similarity, the
    elements outside |a-b| <= atol + rtol*|b| (numpy.isclose's rule) and NaN/Inf
    positions that differ (NaN equals NaN); then file metadata and HDF5
    attributes. Exit status 0 when both hold the same names, shapes, values
    within tolerance and metadata, and everything could be compared; 3 when
    anything differs or could not be compared; 1 for an unreadable file.
    --tensors-only still lists metadata differences but leaves them out of
    the verdict (a GGUF against the safetensors it was converted from).

    \b
    Example:
        tclip diff before.npz after.safetensors
        tclip diff --rtol 1e-3 --map 'model.*=*' a.safetensors b.h5
        tclip diff --tensors-only model-f32.gguf model.safetensors
    """
    from ..formats.limits import names_within
    from .runner import run_diff

    with names_within(kwargs["memory"]):
        ctx.exit(run_diff(**kwargs))




@cli.command("convert")
@click.argument("source", type=FILES, metavar="SRC")
@click.argument("target", type=click.Path(path_type=Path), metavar="DEST")
@click.option("--max-shard-size", default="5GB", show_default=True, metavar="SIZE",
              help="A folder's largest shard, as save_pretrained reads it (5GB = 5*10^9 bytes, 2GiB = 2*2^30).")
@click.option("--force", is_flag=True, help="Replace existing outputs.")
@click.option("--drop-nonnumeric", is_flag=True,
              help="Drop what the output format cannot hold (strings, metadata) with a warning.")
@budget_options
@selection_options("Convert")
@display_options
@click.pass_context
def convert_command(ctx: click.Context, source: str, target: Path, max_shard_size: str, **kwargs: Any) -> None:
    """Write the tensors of SRC (a file, an index, a folder, a DCP checkpoint) to DEST, unchanged.

    DEST with a tensor file suffix is one file of that format; any other DEST
    is a folder as save_pretrained writes it: model.safetensors, or shards of at
    most --max-shard-size and model.safetensors.index.json, with the source
    folder's config and tokenizer files. Optimizer state (and a DCP folder's
    pickled items) is left out unless --include names it. Memory stays within
    --memory whatever the checkpoint's size; nothing is left behind on failure.

    \b
    Example:
        tclip convert checkpoint/step-1000 hf-model/
        tclip convert --max-shard-size 2GB model.safetensors.index.json out/
        tclip convert weights.npz weights.safetensors
    """
    from ..work.convert import parse_shard_size

    try:
        parse_shard_size(max_shard_size)
    except ValueError as error:
        raise click.BadParameter(str(error), param_hint="'--max-shard-size'") from None
    from ..formats.limits import names_within
    from .convert_run import run_convert

    with names_within(kwargs["memory"]):
        ctx.exit(run_convert(source=source, target=target, max_shard_size=max_shard_size, **kwargs))
