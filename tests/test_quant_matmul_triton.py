"""The Triton GGUF matmul (kernels/triton/quant_matmul.py), the CUDA path's kernel, here under the CPU
interpreter (tests/conftest.py sets TRITON_INTERPRET=1): against ``gguf.quants.dequantize(bytes) @ x`` in
float64, for Q8_0, Q4_0, Q4_1 (files' blocks and hand-made ones: negative scales, Q4_1's min, every
byte value), Q4_K and Q6_K (hand-made: gguf's quantizer writes no K-quants; every 6-bit scale and min,
every int8 scale); and ``CudaQuantLinear`` on CPU tensors. The same on a real GPU: tests/gpu/.

The tolerance is derived, not tuned. Under the interpreter the operands are float32 and exact (a block's
integers, fp16 scales, Q4_K's ``d * scale`` and ``dmin * min``: 11 by 6 bits, Q6_K's 11 by 8); the kernel
rounds (unit u = 2^-24) in: the 32-term dot of each block (Q6_K: two 16-term ones, each scaled, then
added), the scale product, the sum over K / 32 blocks, and for Q4_1
and Q4_K the 32-term sum of x, its product with the min and that add, and the bias add. A sum of n
float32 roundings is within gamma_n = n u / (1 - n u) of the exact value times the sum of the
magnitudes, so every output is within gamma_n * (|x| @ (|d q| + |m|)^T + |bias|) with n = 32 + K / 32 + 4,
where |d q| <= |w| + |m| (w the dequantized value, m its min: Q4_1's fp16 m; for Q4_K bounded by
63 |dmin|, the largest 6-bit min).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, quants

from engine.quant.cuda_linear import CudaQuantLinear, cuda_linear_for
from engine.quant.weight import QuantizedWeight
from kernels.triton.quant_matmul import FORMATS, quant_matmul

U32 = 2.0**-24


def reference(x: np.ndarray, blocks: np.ndarray, type_name: str, bias: np.ndarray | None = None):
    """(x @ dequantized^T + bias in float64, the derived bound on each output's float32 error)."""
    w = quants.dequantize(blocks, GGMLQuantizationType[type_name]).astype(np.float64)
    m = np.zeros_like(w)
    if type_name in ("Q4_1", "Q4_K"):  # bytes 2-3 of each block: Q4_1's min, Q4_K's dmin
        per_block, size, _ = FORMATS[type_name]
        mins = blocks.reshape(blocks.shape[0], -1, size)[:, :, 2:4].copy().view(np.float16).astype(np.float64)
        m = np.repeat(np.abs(mins[:, :, 0]) * (63 if type_name == "Q4_K" else 1), per_block, axis=1)
    x64 = x.astype(np.float64)
    exact = x64 @ w.T + (0.0 if bias is None else bias.astype(np.float64))
    n = 32 + x.shape[1] // 32 + 4
    gamma = n * U32 / (1 - n * U32)
    magnitude = np.abs(x64) @ (np.abs(w) + 2 * np.abs(m)).T + (0.0 if bias is None else np.abs(bias))
    return exact, gamma * magnitude


def assert_within(got: torch.Tensor, exact: np.ndarray, bound: np.ndarray) -> None:
    err = np.abs(got.double().numpy() - exact)
    assert (err <= bound).all(), f"max error {err.max():.3e}, at most {bound[err > bound].min():.3e} allowed there"


def file_blocks(rng, type_name: str, n: int, k: int) -> np.ndarray:
    """A random weight as gguf's quantizer (llama.cpp's reference one) writes it: [n, row bytes] uint8."""
    return quants.quantize(rng.standard_normal((n, k)).astype(np.float32), GGMLQuantizationType[type_name])


def hand_blocks(rng, type_name: str, n: int, k: int) -> np.ndarray:
    """Blocks of random bytes (every int8 and nibble value) with chosen fp16 scales of both signs, and
    Q4_1 mins of both signs: layouts a quantizer may never write but a file may hold."""
    per_block, size, _ = FORMATS[type_name]
    raw = rng.integers(0, 256, size=(n, k // per_block, size), dtype=np.uint8)
    scales = rng.choice([-0.75, -0.0123, 0.002, 0.5, -1.5], size=(n, k // per_block)).astype(np.float16)
    at = 208 if type_name == "Q6_K" else 0  # where the fp16 d sits in the block
    raw[:, :, at : at + 2] = scales[:, :, None].view(np.uint8)
    if type_name in ("Q4_1", "Q4_K"):  # the fp16 after d: Q4_1's min, Q4_K's dmin
        mins = rng.choice([-2.0, -0.25, 0.0, 0.125, 3.0], size=(n, k // per_block)).astype(np.float16)
        raw[:, :, 2:4] = mins[:, :, None].view(np.uint8)
    return raw.reshape(n, -1)


@pytest.mark.parametrize("type_name", ["Q8_0", "Q4_0", "Q4_1"])
@pytest.mark.parametrize(("m", "n", "k"), [(1, 32, 64), (3, 40, 128), (5, 64, 96)])
def test_file_blocks_match_dequantized_product(type_name: str, m: int, n: int, k: int) -> None:
    rng = np.random.default_rng(k * 1000 + n + m)
    blocks = file_blocks(rng, type_name, n, k)
    x = rng.standard_normal((m, k)).astype(np.float32)
    exact, bound = reference(x, blocks, type_name)
    got = quant_matmul(torch.from_numpy(x), torch.from_numpy(blocks), type_name)
    assert got.dtype == torch.float32 and got.shape == (m, n)
    assert_within(got, exact, bound)


@pytest.mark.parametrize(
    ("type_name", "k"), [("Q8_0", 128), ("Q4_0", 128), ("Q4_1", 128), ("Q4_K", 512), ("Q6_K", 512)]
)
def test_hand_made_blocks_negative_scales_and_mins_with_bias(type_name: str, k: int) -> None:
    rng = np.random.default_rng(7)
    blocks = hand_blocks(rng, type_name, 48, k)
    x = rng.standard_normal((4, k)).astype(np.float32)
    bias = rng.standard_normal(48).astype(np.float32)
    exact, bound = reference(x, blocks, type_name, bias)
    got = quant_matmul(torch.from_numpy(x), torch.from_numpy(blocks), type_name, torch.from_numpy(bias))
    assert_within(got, exact, bound)


def test_strided_activations_are_read_by_row_stride() -> None:
    rng = np.random.default_rng(3)
    blocks = file_blocks(rng, "Q8_0", 32, 64)
    wide = torch.from_numpy(rng.standard_normal((2, 96)).astype(np.float32))
    x = wide[:, 16:80]  # a view: row stride 96
    exact, bound = reference(x.contiguous().numpy(), blocks, "Q8_0")
    assert_within(quant_matmul(x, torch.from_numpy(blocks), "Q8_0"), exact, bound)


def test_bad_inputs_are_refused_with_what_was_expected() -> None:
    blocks = torch.zeros((8, 2 * 34), dtype=torch.uint8)
    with pytest.raises(ValueError, match="no Triton kernel for I8"):
        quant_matmul(torch.zeros(1, 64), torch.zeros((8, 68), dtype=torch.uint8), "I8")
    with pytest.raises(ValueError, match=r"Q4_K activations must be \[rows, a multiple of 256\]"):
        quant_matmul(torch.zeros(1, 128), torch.zeros((8, 72), dtype=torch.uint8), "Q4_K")
    with pytest.raises(ValueError, match=r"Q8_0 rows for 96 inputs are \[N, 102\] uint8"):
        quant_matmul(torch.zeros(1, 96), blocks, "Q8_0")
    with pytest.raises(ValueError, match="multiple of 32"):
        quant_matmul(torch.zeros(1, 60), blocks, "Q8_0")


def test_cuda_linear_module_on_cpu_tensors() -> None:
    """The module the CUDA loader puts in a projection's place, run here on CPU tensors: leading dims kept,
    bias added, and a format without a kernel (I8) left to the loader's float weight (None)."""
    rng = np.random.default_rng(11)
    blocks = file_blocks(rng, "Q4_1", 40, 64)
    bias = torch.from_numpy(rng.standard_normal(40).astype(np.float32))
    module = cuda_linear_for(
        QuantizedWeight("Q4_1", torch.from_numpy(blocks), 64), bias, torch.device("cpu"), torch.float32
    )
    assert isinstance(module, CudaQuantLinear)
    x = torch.from_numpy(rng.standard_normal((2, 3, 64)).astype(np.float32))
    exact, bound = reference(x.reshape(6, 64).numpy(), blocks, "Q4_1", bias.numpy())
    y = module(x)
    assert y.shape == (2, 3, 40)
    assert_within(y.reshape(6, 40), exact, bound)
    per_channel = QuantizedWeight("I8", torch.zeros((4, 68), dtype=torch.uint8), 64)
    assert cuda_linear_for(per_channel, None, torch.device("cpu"), torch.float32) is None
