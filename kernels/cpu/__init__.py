"""The C kernels for CPU tensors, built on first use and called through ctypes, and the on-disk cache of timed picks."""
