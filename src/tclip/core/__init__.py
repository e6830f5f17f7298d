"""Arrays in memory, no files: the arithmetic every command and the NumPy API share.

- :mod:`~tclip.core.dtypes`: which dtypes are floating (ml_dtypes' bfloat16 and float8 included);
- :mod:`~tclip.core.units`: the fixed grid of reduction units a tensor is summed over;
- :mod:`~tclip.core.exact`: sums kept exactly, rounded once;
- :mod:`~tclip.core.kernels`: widening, narrowing, reducing, scaling and clamping one unit;
- :mod:`~tclip.core.stats`: statistics accumulated unit by unit and merged (pass 1);
- :mod:`~tclip.core.modes`: the clip modes and their scale-factor arithmetic (the plan);
- :mod:`~tclip.core.compare`: comparing two units (``tclip diff``'s arithmetic);
- :mod:`~tclip.core.ops`: TensorFlow's functions over whole arrays.

Nothing here opens a file or imports click or rich; the formats and the passes over
files build on it (``core < formats < work < cli``).
"""
