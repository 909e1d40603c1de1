"""``model.load_format: dummy`` (vLLM's --load-format dummy): weights made on the device in the target
dtype from config.json alone; and the Llama-3-8B shape, made without a checkpoint."""

from __future__ import annotations

import argparse
import shutil

import pytest
import torch

from cluster.make_model import build_config, make_model
from cluster.vllm_flags import add_vllm_groups, vllm_overrides
from configs.loader import load_config
from engine.llm import LLM
from engine.model.config import HFModelConfig
from engine.model.loader import load_model
from engine.model.model import CausalLM
from engine.sampling.params import SamplingParams
from tests.model_factory import tiny_model_dir


@pytest.fixture
def config_only(tmp_path):
    """The tiny llama's directory without its weights: config.json (and the tokenizer) only."""
    src = tiny_model_dir("llama")
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(src / name, tmp_path / name)
    return tmp_path


def test_dummy_weights_have_the_checkpoints_shapes_on_the_device_in_the_dtype(config_only):
    real, _ = load_model(tiny_model_dir("llama"), dtype="float32")
    dummy, config = load_model(config_only, dtype="bfloat16", load_format="dummy")
    real_params, dummy_params = dict(real.named_parameters()), dict(dummy.named_parameters())
    assert real_params.keys() == dummy_params.keys()
    for name, param in dummy_params.items():
        assert param.shape == real_params[name].shape and param.dtype == torch.bfloat16, name
        assert param.device.type == "cpu" and not param.requires_grad
        if name.endswith("norm.weight"):
            assert torch.equal(param, torch.ones_like(param)), name
        elif param.ndim == 2:
            assert 0 < param.abs().max().item() <= 1e-3, name
    # Same seed, same weights: two dummy loads are the same model.
    again, _ = load_model(config_only, dtype="bfloat16", load_format="dummy")
    assert all(torch.equal(p, dict(again.named_parameters())[n]) for n, p in dummy_params.items())


def test_without_safetensors_auto_refuses_and_dummy_serves(config_only):
    with pytest.raises(FileNotFoundError, match="safetensors"):
        load_model(config_only, load_format="auto")
    with pytest.raises(ValueError, match="unknown load format 'random'"):
        load_model(config_only, load_format="random")
    config = load_config(None, env={}, overrides={"model.load_format": "dummy", "engine.kv_cache_memory_mb": 16})
    llm = LLM(str(config_only), config=config, device="cpu")
    out = llm.generate([[5, 6, 7, 8, 9]], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 4


def test_load_format_in_the_config_and_the_vllm_flag():
    with pytest.raises(Exception, match="load_format"):
        load_config(None, env={}, overrides={"model.load_format": "random"})
    parser = argparse.ArgumentParser()
    add_vllm_groups(parser, "decode")
    args = parser.parse_args(["--load-format", "dummy"])
    assert vllm_overrides(args, "decode")["model.load_format"] == "dummy"
    with pytest.raises(SystemExit):
        parser.parse_args(["--load-format", "pt"])


def test_llama3_8b_shape_without_a_checkpoint(tmp_path):
    path = make_model("llama", "llama3-8b", tmp_path / "l3")
    assert not list(path.glob("*.safetensors"))
    config = HFModelConfig.from_hf_dir(path)
    shape = (config.num_layers, config.hidden_size, config.intermediate_size, config.num_heads, config.num_kv_heads)
    assert shape == (32, 4096, 14336, 32, 8) and config.vocab_size == 128256 and config.head_dim == 128
    assert not config.tie_word_embeddings
    # On the meta device (no memory): Meta-Llama-3-8B's published parameter count, 8,030,261,248.
    lm = CausalLM(config, torch.device("cpu"))
    assert sum(p.numel() for p in lm.parameters()) == 8_030_261_248
    with pytest.raises(ValueError, match="llama shape"):
        build_config("qwen2", "llama3-8b")
