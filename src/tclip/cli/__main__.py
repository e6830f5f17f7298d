"""``python -m tclip.cli``, as ``python -m tclip``."""

from .entry import main

main()
