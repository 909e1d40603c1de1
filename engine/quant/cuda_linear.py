"""A GGUF projection kept quantized on a CUDA device: ``QuantLinear``'s sibling for the GPU.

The weight stays the file's own rows of blocks (engine/quant/weight.py), copied to the device as bytes,
and every call runs the Triton kernel of kernels/triton/quant_matmul.py on them: Q8_0, Q4_0, Q4_1,
Q4_K and Q6_K. The CPU's C kernels and their forms (engine/quant/linear.py) are not involved. A format
with no kernel here (this package's CPU ``I8``): ``cuda_linear_for`` returns None and the loader keeps
the float weight it made at load (dequantized to the model's dtype), saying so in its log.
"""

from __future__ import annotations

import torch
from torch import nn

from engine.quant.weight import QuantizedWeight
from kernels.triton.quant_matmul import FORMATS, quant_matmul

CUDA_FORMATS = tuple(FORMATS)  # the formats that stay quantized on CUDA


class CudaQuantLinear(nn.Module):
    """``x @ W^T + bias`` with W as GGUF blocks on the device; the output in the activations' dtype."""

    def __init__(self, weight: QuantizedWeight, bias: torch.Tensor | None, device: torch.device, dtype: torch.dtype):
        super().__init__()
        if weight.type_name not in CUDA_FORMATS:
            raise ValueError(f"no CUDA kernel for {weight.type_name}; kernels: {', '.join(CUDA_FORMATS)}")
        self.type_name = weight.type_name
        self.in_features, self.out_features = weight.in_features, weight.out_features
        # a buffer, not a parameter: raw bytes, moved with the module and never trained
        self.register_buffer("blocks", weight.rows.to(device), persistent=False)
        self.register_parameter(
            "bias", None if bias is None else nn.Parameter(bias.to(device, dtype).contiguous(), requires_grad=False)
        )
        # set by CausalLM.enable_lora, as on QuantLinear
        self.lora_key: tuple[int, str] | None = None
        self.lora_ref = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        x2 = x.reshape(-1, x.shape[-1])
        y = quant_matmul(x2, self.blocks, self.type_name, self.bias)
        if self.lora_ref is not None and self.lora_ref.step.groups:
            self.lora_ref.step.add_delta(self.lora_key, x2, y)
        return y.reshape(*lead, self.out_features)

    def extra_repr(self) -> str:
        return f"{self.type_name} on {self.blocks.device}, in={self.in_features}, out={self.out_features}"


def cuda_linear_for(
    weight: QuantizedWeight, bias: torch.Tensor | None, device: torch.device, dtype: torch.dtype
) -> CudaQuantLinear | None:
    """The quantized linear of ``weight`` on ``device``, or None where its format has no kernel here."""
    return CudaQuantLinear(weight, bias, device, dtype) if weight.type_name in CUDA_FORMATS else None
