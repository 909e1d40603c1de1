"""``--kv-cache-dtype`` on a GPU, decided without one: which dtype the pool gets for each setting and
compute capability (vLLM's rule: e4m3 from 8.9, Ada and Hopper), what a block costs in bytes against
bfloat16's, and how many tokens a budget holds. The kernels that read these pools: tests/test_kv_quant_triton.py
(interpreter) and tests/gpu/test_gpu_kv_dtypes.py (a GPU)."""

from __future__ import annotations

import pytest
import torch

from configs.schema import ConfigError
from engine.kv.cache_dtype import kv_storage_dtype
from engine.kv.pool import KVLayout, num_blocks_for_budget


@pytest.fixture
def gpu_of_capability(monkeypatch):
    """Pretend a GPU of the given compute capability (no CUDA needed: only the capability is read)."""

    def set_capability(major: int, minor: int, name: str) -> None:
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (major, minor))
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)

    return set_capability


@pytest.mark.parametrize("capability,name", [((8, 9), "NVIDIA L4"), ((9, 0), "NVIDIA H200"), ((10, 0), "NVIDIA B200")])
def test_fp8_is_e4m3_from_compute_capability_8_9(gpu_of_capability, capability, name):
    gpu_of_capability(*capability, name)
    assert kv_storage_dtype("fp8", torch.bfloat16, "cuda") is torch.float8_e4m3fn
    assert kv_storage_dtype("int8", torch.bfloat16, "cuda:0") is torch.int8


@pytest.mark.parametrize("capability,name", [((8, 0), "NVIDIA A100-SXM4-80GB"), ((7, 5), "Tesla T4")])
def test_fp8_on_an_older_gpu_is_a_start_up_error_naming_what_it_needs(gpu_of_capability, capability, name):
    gpu_of_capability(*capability, name)
    major, minor = capability
    with pytest.raises(ConfigError) as info:
        kv_storage_dtype("fp8", torch.bfloat16, "cuda")
    assert str(info.value) == (
        f"engine.kv_cache_dtype fp8 (e4m3) needs compute capability 8.9 or newer; cuda ({name}) has "
        f"{major}.{minor}: use int8 or auto"
    )
    assert kv_storage_dtype("int8", torch.bfloat16, "cuda") is torch.int8  # what it suggests works there


def test_fp8_on_cpu_stays_a_start_up_error():
    with pytest.raises(ConfigError, match="fp8 \\(e4m3\\) needs a GPU; this worker runs on cpu: use int8 or auto"):
        kv_storage_dtype("fp8", torch.float32, "cpu")


@pytest.mark.parametrize("head_dim,int8_ratio", [(64, 72 / 128), (128, 144 / 256)])
def test_block_bytes_and_capacity_against_bfloat16(head_dim, int8_ratio):
    """SmolLM2-135M's KV shape (30 layers, 3 KV heads) and an 8B's head size: fp8 is half of bfloat16's
    bytes (one byte a value), int8 0.5625x (a float16 scale per 16 values rides in the row)."""
    layout = {
        dtype: KVLayout(30, 1, 16, 3, head_dim, dtype) for dtype in (torch.bfloat16, torch.float8_e4m3fn, torch.int8)
    }
    bf16 = layout[torch.bfloat16].bytes_per_block
    assert bf16 == 30 * 2 * 16 * 3 * head_dim * 2
    assert layout[torch.float8_e4m3fn].bytes_per_block / bf16 == 0.5
    assert layout[torch.int8].bytes_per_block / bf16 == int8_ratio
    budget = 1 << 30
    tokens = {dtype: num_blocks_for_budget(budget, lay.bytes_per_block) * 16 for dtype, lay in layout.items()}
    assert tokens[torch.float8_e4m3fn] >= 2 * tokens[torch.bfloat16] - 16  # twice, up to a block's rounding
    assert tokens[torch.int8] >= tokens[torch.bfloat16] / int8_ratio - 16
