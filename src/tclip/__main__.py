"""``python -m tclip``."""

from ._entry import main

main()
