"""The options of a clipping run: where outputs go and how awkward tensors are treated."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from .budget import Budget
from .passes import IN_MEMORY_TENSOR_BYTES
from .selection import Selection


@dataclass(frozen=True)
class ClipOptions:
    """How :func:`clip_file` writes its result and treats awkward tensors.

    Attributes:
        output: the output path (its suffix picks the format); default
            ``NAME.clipped.EXT`` beside the input, or in ``out_dir``.
        in_place: replace the input itself (atomically).
        overwrite: replace an existing output.
        nonfinite: "error" refuses a file whose selected tensors hold NaN/Inf,
            "propagate" computes TensorFlow's result.
        strict: tensors whose rank cannot take ``--axes`` are an error, not skipped.
        dry_run: compute the report, write nothing.
        block_bytes: the largest block read at once (None: sized from ``memory``).
        memory, threads: the budget of a pass (:class:`tclip.work.budget.Budget`).
        drop_nonnumeric: a conversion drops what the output format cannot hold
            (non-numeric datasets, metadata), with a warning, instead of failing.
        hold_bytes: tensors up to this size that pass 1 reads are kept in memory for
            pass 2 (within an eighth of ``memory``), so they are read once; 0: every
            tensor is read twice.
        measure_after: measure the values written (the report's "after" column);
            the command line skips it when it shows no report (-q).
    """

    output: Path | None = None
    out_dir: Path | None = None
    in_place: bool = False
    overwrite: bool = False
    selection: Selection = field(default_factory=Selection)
    nonfinite: str = "error"
    strict: bool = False
    dry_run: bool = False
    block_bytes: int | None = None
    memory: int = Budget.memory
    threads: int = 0
    drop_nonnumeric: bool = False
    hold_bytes: int = IN_MEMORY_TENSOR_BYTES
    measure_after: bool = True

    @property
    def budget(self) -> Budget:
        return Budget(self.memory, self.threads, self.block_bytes)
