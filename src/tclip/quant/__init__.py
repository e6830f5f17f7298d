"""Quantized weights, between the formats and the passes (moved here from core/ and formats/)."""
