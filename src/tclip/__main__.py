"""``python -m tclip``."""

from .cli.entry import main

main()
