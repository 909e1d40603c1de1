"""Quantized weights kept quantized: GGUF blocks and per-channel int8, run by the C kernels of kernels/cpu/quant.c."""
