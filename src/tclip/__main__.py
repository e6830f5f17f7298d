"""``python -m tclip``."""

from .cli import main

main()
