"""Quantized weights, between the formats and the passes: a format lists what is stored, this
package computes what it means.

- :mod:`~tclip.quant.contract`: the typed contract of an encoding that computes
  (:class:`~tclip.quant.contract.QuantEncoding`, its :class:`~tclip.quant.contract.ValueSource`
  and :class:`~tclip.quant.contract.Reducer`);
- :mod:`~tclip.quant.codes`: codes times scales, the arithmetic (FP8/NVFP4/MXFP4 codes, scale
  rounding, closed-form statistics, what the stored parts hold: ``Findings``);
- :mod:`~tclip.quant.layout`: which stored tensors make up which weight (names, shapes, configs);
- :mod:`~tclip.quant.encoding`: the encoding of codes plus scale tensors;
- :mod:`~tclip.quant.ggml`: ggml's blocks (GGUF): dequantization, exact statistics, scale
  rewrites, and the encoding of a GGUF tensor of blocks;
- :mod:`~tclip.quant.view`: files and sets seen as their logical tensors
  (:func:`~tclip.quant.view.open_logical`, :func:`~tclip.quant.view.logical_view`).

Layers: core < formats < quant < work. Nothing here knows a pass, a plan or a report; what
the passes make of a quantized weight (refusals, notes) is :mod:`tclip.work.quantized`.
"""
