"""``--kv-cache-dtype`` (vLLM's flag): what the KV pool stores, given the model's dtype and the device.

``auto`` stores the model's dtype. ``int8`` stores symmetric int8 with float16 scales (one per 16
values of a token's head), packed in the row (kernels/triton/kv_int8.py); CPU only so far (the
Triton kernels do not read it yet: a clear start-up error on CUDA). ``fp8`` stores e4m3 with vLLM's
default scale of 1.0; it needs a GPU (CPUs here have no e4m3 arithmetic, and nothing on the CPU paths
reads it), so on CPU it is a start-up error rather than a silent fallback. On CUDA it is not yet run
on a GPU: unverified.
"""

from __future__ import annotations

import torch

from configs.schema import ConfigError

KV_CACHE_DTYPES = ("auto", "int8", "fp8")


def kv_storage_dtype(setting: str, model_dtype: torch.dtype, device: str) -> torch.dtype:
    """The pool tensor's dtype for ``setting`` (one of KV_CACHE_DTYPES)."""
    if setting == "auto":
        return model_dtype
    if setting == "int8":
        if str(device).startswith("cuda"):  # the Triton kernels read float pools only, so far
            raise ConfigError("engine.kv_cache_dtype int8 runs on CPU only so far; on a GPU use fp8 or auto")
        return torch.int8
    if setting == "fp8":
        if not str(device).startswith("cuda"):
            raise ConfigError(
                f"engine.kv_cache_dtype fp8 (e4m3) needs a GPU; this worker runs on {device}: use int8 or auto"
            )
        return torch.float8_e4m3fn
    raise ConfigError(f"engine.kv_cache_dtype {setting!r} is not one of {', '.join(KV_CACHE_DTYPES)}")
