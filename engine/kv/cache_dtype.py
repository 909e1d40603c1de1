"""``--kv-cache-dtype`` (vLLM's flag): what the KV pool stores, given the model's dtype and the device.

``auto`` stores the model's dtype. ``int8`` stores symmetric int8 with float16 scales (one per 16
values of a token's head), packed in the row (kernels/triton/kv_int8.py), on CPU (the C kernels) and
on CUDA (the Triton kernels). ``fp8`` stores e4m3 with vLLM's default scale of 1.0, saturated at
+-448 (kernels/triton/store_kv.py); it needs a GPU with e4m3 conversions, compute capability 8.9 or
newer (Ada, Hopper, Blackwell): on an older GPU, and on CPU (no e4m3 arithmetic here, and nothing on the
CPU paths reads it), it is a start-up error rather than a silent fallback. The CUDA kernels for both
are tested under the Triton interpreter on CPU; what waits for a GPU run: docs/gpu.md.
"""

from __future__ import annotations

import torch

from configs.schema import ConfigError

KV_CACHE_DTYPES = ("auto", "int8", "fp8")
FP8_MIN_CAPABILITY = (8, 9)  # the first GPUs with e4m3 conversion instructions (cvt.e4m3x2)


def kv_storage_dtype(setting: str, model_dtype: torch.dtype, device: str) -> torch.dtype:
    """The pool tensor's dtype for ``setting`` (one of KV_CACHE_DTYPES)."""
    if setting == "auto":
        return model_dtype
    if setting == "int8":
        return torch.int8
    if setting == "fp8":
        if not str(device).startswith("cuda"):
            raise ConfigError(
                f"engine.kv_cache_dtype fp8 (e4m3) needs a GPU; this worker runs on {device}: use int8 or auto"
            )
        capability = torch.cuda.get_device_capability(device)
        if capability < FP8_MIN_CAPABILITY:
            raise ConfigError(
                f"engine.kv_cache_dtype fp8 (e4m3) needs compute capability "
                f"{'.'.join(map(str, FP8_MIN_CAPABILITY))} or newer; {device} ({torch.cuda.get_device_name(device)}) "
                f"has {'.'.join(map(str, capability))}: use int8 or auto"
            )
        return torch.float8_e4m3fn
    raise ConfigError(f"engine.kv_cache_dtype {setting!r} is not one of {', '.join(KV_CACHE_DTYPES)}")
