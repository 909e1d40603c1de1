"""The activations as the ``int`` form's kernel sees them, for the ``panel`` form (engine/quant/linear.py).

kernels/cpu/quant.c rounds each row of x to int8 blocks of 16 (a float32 scale per 16 values; llama.cpp's
CPU backend rounds activations to Q8 blocks of 32 at every batch size), and with ``model.quant_activations:
int16`` adds a second int8 term, what the first rounding left rounded again, so x reaches the integer dot
products to about 1/64516 of each block's max rather than 1/254. The ``panel`` form multiplies a
dequantized float32 panel by x; on x itself it would compute a different function, and which form a row
count takes is timed at start (engine/quant/forms.py): the same prompt on the same file then gave
different greedy text in two processes whose timings differed (SmolLM2 Q4_1, "What is the capital of
France?": "L'Étoile, la Marseur, ..." with ``int`` at 37 rows, "L'Étoile, la Cité, ..." with ``panel``).
Rounded here as the kernel rounds, x gives both forms the same products, so they differ only in the order
of float32 sums, as llama.cpp's GEMV and GEMM paths do.
"""

from __future__ import annotations

import torch

BLOCK = 16  # values per activation scale, quant.c's quantize_row (ACT_BLOCK in quant_formats.h)


def as_int8_blocks(x: torch.Tensor) -> torch.Tensor:
    """x [rows, in] float32 (in a multiple of 16) with each block of 16 values replaced by d * q, where
    d = max|x| / 127 over the block and q = x * (127 / max|x|) rounded half to even (``lrintf``)."""
    assert x.dtype == torch.float32 and x.dim() == 2 and x.shape[1] % BLOCK == 0, (x.dtype, x.shape)
    blocks = x.reshape(x.shape[0], -1, BLOCK)  # [rows, in / 16, 16]
    amax = blocks.abs().amax(dim=-1, keepdim=True)  # [rows, in / 16, 1]
    limit = torch.full_like(amax, 127.0)
    # tensor by tensor: ``127 / amax`` would be torch's reciprocal times 127, a float away from C's 127 / amax,
    # which moves the rounding of a value that lands on a half (98.5 -> 98 or 99)
    inv = torch.where(amax > 0, limit / amax, torch.zeros_like(amax))  # an all-zero block stays zero
    q = torch.round(blocks * inv)  # torch.round is half to even, as lrintf in the default rounding mode
    return (q * (amax / limit)).reshape(x.shape)


def as_int8_terms(x: torch.Tensor, terms: int) -> torch.Tensor:
    """x as the sum of its ``terms`` int8-block roundings (quant.c's quantize_row): each ``as_int8_blocks``
    of what the terms before left (x - term, one rounded difference, as quant.c computes it), added in
    order in float32."""
    total = as_int8_blocks(x)
    left = x - total
    for _ in range(terms - 1):
        term = as_int8_blocks(left)
        total, left = total + term, left - term
    return total
