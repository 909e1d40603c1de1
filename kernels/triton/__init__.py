"""Triton kernels for CUDA tensors, each beside the torch reference that CPU tensors run."""
