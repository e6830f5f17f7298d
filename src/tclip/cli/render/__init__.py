"""Rendering for people (rich ``Text`` lines, styles only, no markup ever parsed).

- :mod:`~tclip.cli.render.table`: the table layout every view shares, name shortening, symbols;
- :mod:`~tclip.cli.render.report`: a file's (or tensor set's) report;
- :mod:`~tclip.cli.render.info`: ``tclip info``;
- :mod:`~tclip.cli.render.diff`: ``tclip diff``;
- :mod:`~tclip.cli.render.summary`: ``tclip report --summary``.
"""
