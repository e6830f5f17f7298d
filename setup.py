"""The one compiled part of tclip: the fused statistics loop, src/tclip/core/_fused.c.

Everything else is declared in pyproject.toml. The extension is optional: where it cannot
be built (no C compiler), the install still succeeds and tclip computes the same bits with
NumPy, more slowly (tclip.core.kernels chooses at run time).
"""

import sys

from setuptools import Extension, setup

# No contraction of a product and a sum into one fused multiply-add: every square is
# rounded on its own, as NumPy rounds it (see the comment at the top of _fused.c).
# -fno-wrapv undoes the -fwrapv Python's own flags bring, which kept GCC from vectorizing
# the bfloat16 loop (0.6 -> 0.8 ns an element); the C code never overflows a signed integer.
FLAGS = [] if sys.platform == "win32" else ["-O3", "-ffp-contract=off", "-fno-wrapv"]

setup(ext_modules=[Extension("tclip.core._fused", ["src/tclip/core/_fused.c"], optional=True,
                             extra_compile_args=FLAGS)])
