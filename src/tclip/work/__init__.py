"""Passes over files: the work every command does, as a library (no click, no rich).

- :mod:`~tclip.work.selection`: which tensors a command works on, and why the others are skipped;
- :mod:`~tclip.work.budget`: memory and threads of a pass, the block runner;
- :mod:`~tclip.work.passes`: the one unit-by-unit pass driver (sources, sinks, held tensors);
- :mod:`~tclip.work.statistics`: pass 1 (:class:`FileStats`);
- :mod:`~tclip.work.plan`: from statistics and a mode to each tensor's work (:class:`Plan`);
- :mod:`~tclip.work.rewrite`: pass 2 (:class:`RewriteResult`);
- :mod:`~tclip.work.options`: the options of a clipping run (:class:`ClipOptions`);
- :mod:`~tclip.work.policy`: what is refused or warned about before any data is read;
- :mod:`~tclip.work.clip`: ``clip_file``, ``report_file``, ``file_info``: the steps composed for one file;
- :mod:`~tclip.work.sets`: the same over a tensor set (shards, ``--across-files``, Dask);
- :mod:`~tclip.work.journal`: the journal of an in-place rewrite of a set;
- :mod:`~tclip.work.diff`: two files compared in step; :mod:`~tclip.work.mapping`: ``--map``
  rename rules (linear-time globs, suggestions); :mod:`~tclip.work.metadata_diff`: their
  metadata and attributes compared;
- :mod:`~tclip.work.results`: report data and its JSON; :mod:`~tclip.work.reporting` fills it;
- :mod:`~tclip.work.gate`: ``report --max-norm``; :mod:`~tclip.work.summary`: ``report --summary``'s data;
- :mod:`~tclip.work.inputs`: which files the inputs name, where outputs go;
- :mod:`~tclip.work.quantized`: quantized weights in the passes: what is refused, warned about, reported.

Every step takes and returns plain, picklable data, so the same steps serve one file,
a sharded set and a cluster.
"""
