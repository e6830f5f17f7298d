"""ggml's quantized blocks (GGUF): :mod:`~tclip.quant.ggml.blocks`."""
