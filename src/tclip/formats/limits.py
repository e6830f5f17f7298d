"""What a file's structure may make tclip hold before any tensor is read: set from ``--memory``.

A format whose names come from an interpreted structure (a torch.save pickle, where shared
sub-trees name one tensor many times) counts each name against this budget: every name
costs the run about :data:`NAME_BYTES` (its info, view, plan entry and report row), so a
file naming more than the budget holds is refused at once, not after minutes of work.

The budget is process-wide, not per thread: the command line sets it once per command
(:func:`names_within`) and files opened on worker threads read the same value.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

#: What one tensor name costs a run, in bytes (measured: a PyTorch file of 20 000 tensors
#: peaked at ~8 KiB a name through ``norm``, ~2 KiB through ``info``).
NAME_BYTES = 4096
#: The budget when no command set one (``info``, library calls): ``--memory``'s default.
DEFAULT_MEMORY = 256 << 20

_memory = DEFAULT_MEMORY


def name_memory() -> int:
    """The bytes names may take in this process (``--memory`` of the running command)."""
    return _memory


@contextmanager
def names_within(memory: int) -> Iterator[None]:
    """Count names against ``memory`` bytes while the block runs (restored after).

    Args:
        memory: the command's ``--memory``, in bytes.
    """
    global _memory
    previous, _memory = _memory, max(1, int(memory))
    try:
        yield
    finally:
        _memory = previous
