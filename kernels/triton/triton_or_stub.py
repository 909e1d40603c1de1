"""``triton`` and ``triton.language`` where Triton is installed; otherwise a stand-in, so the CPU path
imports the kernel modules without it.

Triton serves CUDA tensors only, and it is ~1 GB: the CPU container image (deploy/Dockerfile) leaves it
out. Without it the ``@triton.jit`` kernels become stand-ins that say so when launched; the two integer
helpers the launchers use are pure arithmetic and work either way.
"""

from __future__ import annotations

try:
    import triton
    import triton.language as tl

    TRITON_INSTALLED = True
except ImportError:  # the CPU image: every CUDA launch below names what is missing
    import types

    class _NotInstalledKernel:
        def __init__(self, fn):
            self.__name__ = getattr(fn, "__name__", "kernel")

        def __getitem__(self, grid):
            raise RuntimeError(
                f"Triton kernel {self.__name__} needs Triton, which is not installed "
                "(the CPU image leaves it out; CUDA tensors need the CUDA image)"
            )

    triton = types.SimpleNamespace(
        jit=_NotInstalledKernel,
        cdiv=lambda a, b: -(-a // b),
        next_power_of_2=lambda n: 1 if n <= 1 else 1 << (n - 1).bit_length(),
    )
    tl = types.SimpleNamespace()  # only read inside @triton.jit bodies and (lazy) annotations
    TRITON_INSTALLED = False  # callers that have a torch path choose it (engine/lora/stacked.py)

__all__ = ["TRITON_INSTALLED", "tl", "triton"]
