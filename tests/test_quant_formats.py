"""The quantizers of engine/quant/ against llama.cpp's own decoding (``gguf.quants.dequantize``) of the bytes
they write: each value within the step its block's scale allows, and the records' invariants."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, dequantize

from engine.quant.kquants import quantize_q4_k, quantize_q6_k
from engine.quant.weight import QuantizedWeight, concat_rows


def _weight(out_features: int, in_features: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(out_features)
    w = torch.randn(out_features, in_features, generator=g) * 0.05
    w[1, :40] = 0  # a zero sub-block
    w[2] = w[2].abs()  # a row without negatives (Q4_K's min is then 0)
    return w


@pytest.mark.parametrize("shape", [(3, 256), (17, 512), (5, 1536)])
def test_q6_k_round_trip(shape):
    w = _weight(*shape)
    back = dequantize(quantize_q6_k(w).rows.numpy(), GGMLQuantizationType.Q6_K)
    amax16 = w.abs().reshape(-1, 16).amax(dim=1, keepdim=True).numpy()
    amax256 = np.repeat(w.abs().reshape(-1, 256).amax(dim=1).numpy(), 16)[:, None]
    err = np.abs(back - w.numpy()).reshape(-1, 16)
    # one step of the stored scale, which is at most the sub-block's ideal amax / 32 plus one unit of the
    # super-block's int8 scale grid: the largest magnitude lands on -32, the other sign's clips at +31
    assert np.all(err <= amax16 / 32 + amax256 / (32 * 127) + 1e-6)
    assert np.mean(err) <= np.mean(amax16) / 32 / 3  # and mostly within half a step


@pytest.mark.parametrize("shape", [(3, 256), (17, 512), (5, 1536)])
def test_q4_k_round_trip(shape):
    w = _weight(*shape)
    back = dequantize(quantize_q4_k(w).rows.numpy(), GGMLQuantizationType.Q4_K)
    blocks = w.reshape(-1, 32)
    span = (blocks.amax(dim=1, keepdim=True) - blocks.amin(dim=1, keepdim=True).clamp(max=0)).numpy()
    err = np.abs(back - w.numpy()).reshape(-1, 32)
    assert np.all(err <= span / 15 * 0.75 + 1e-6)  # half a step of 4 bits, plus the rounded scale and min


def test_fused_rows_and_bad_records():
    a, b = quantize_q6_k(_weight(4, 256)), quantize_q6_k(_weight(6, 256))
    fused = concat_rows([a, b])
    assert fused.shape == (10, 256) and torch.equal(fused.rows[4:], b.rows)
    with pytest.raises(ValueError, match="one format and width"):
        concat_rows([a, quantize_q4_k(_weight(4, 256))])
    with pytest.raises(ValueError, match="multiples of 256"):
        QuantizedWeight("Q4_K", torch.zeros(2, 72, dtype=torch.uint8), 64)
    with pytest.raises(ValueError, match="no quantized kernel for Q5_K"):
        QuantizedWeight("Q5_K", torch.zeros(2, 176, dtype=torch.uint8), 256)
