"""Checkpoint loading, config parsing and the random-checkpoint maker."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from cluster.make_model import (
    BOS_ID,
    EOS_ID,
    IM_END_ID,
    PAD_ID,
    SPECIAL_TOKENS,
    build_config,
    build_tokenizer,
    main,
    make_model,
)
from engine.model.config import HFModelConfig
from engine.model.loader import load_model
from tests.model_factory import tiny_model_dir


def _copy_with_weights(src, dst, weights: dict[str, torch.Tensor]):
    dst.mkdir()
    shutil.copy(src / "config.json", dst / "config.json")
    save_file(weights, str(dst / "model.safetensors"))
    return dst


def _write_config(dst, **changes):
    dst.mkdir()
    hf = json.loads((tiny_model_dir("llama") / "config.json").read_text())
    hf.update(changes)
    (dst / "config.json").write_text(json.dumps(hf))
    return dst


def test_sharded_checkpoint_loads_like_unsharded(tmp_path):
    src = tiny_model_dir("qwen2")
    AutoModelForCausalLM.from_pretrained(src).save_pretrained(tmp_path, max_shard_size="40KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    assert len(list(tmp_path.glob("*.safetensors"))) > 2
    sharded, _ = load_model(tmp_path)
    whole, _ = load_model(src)
    expected = whole.state_dict()
    got = sharded.state_dict()
    assert got.keys() == expected.keys()
    for name, tensor in expected.items():
        assert torch.equal(got[name], tensor), name


def test_fused_weights_are_the_checkpoint_rows():
    model, config = load_model(tiny_model_dir("qwen2"))
    weights = load_file(str(tiny_model_dir("qwen2") / "model.safetensors"))
    p = "model.layers.1."
    qkv = torch.cat([weights[p + f"self_attn.{n}_proj.weight"] for n in "qkv"])
    gate_up = torch.cat([weights[p + "mlp.gate_proj.weight"], weights[p + "mlp.up_proj.weight"]])
    assert torch.equal(model.layers[1].self_attn.qkv_proj.weight, qkv)
    qkv_bias = torch.cat([weights[p + f"self_attn.{n}_proj.bias"] for n in "qkv"])
    assert torch.equal(model.layers[1].self_attn.qkv_proj.bias, qkv_bias)
    assert torch.equal(model.layers[1].mlp.gate_up_proj.weight, gate_up)
    # qwen2 tiny has tied embeddings: one tensor serves both ends.
    assert config.tie_word_embeddings and model.lm_head is model.embed_tokens
    assert torch.equal(model.embed_tokens, weights["model.embed_tokens.weight"])


def test_missing_tensor_is_named(tmp_path):
    src = tiny_model_dir("llama")
    weights = load_file(str(src / "model.safetensors"))
    del weights["model.layers.1.mlp.up_proj.weight"]
    bad = _copy_with_weights(src, tmp_path / "bad", weights)
    with pytest.raises(ValueError, match=r"missing tensor 'model\.layers\.1\.mlp\.up_proj\.weight'"):
        load_model(bad)


def test_shape_mismatch_names_tensor_and_both_shapes(tmp_path):
    src = tiny_model_dir("llama")
    weights = load_file(str(src / "model.safetensors"))
    weights["model.layers.0.self_attn.k_proj.weight"] = torch.zeros(16, 64)  # config expects [2 * 16, 64]
    bad = _copy_with_weights(src, tmp_path / "bad", weights)
    with pytest.raises(ValueError) as info:
        load_model(bad)
    message = str(info.value)
    assert "model.layers.0.self_attn.k_proj.weight" in message
    assert "[16, 64]" in message and "[32, 64]" in message


def test_unsupported_architecture_is_refused(tmp_path):
    path = _write_config(tmp_path / "gpt2", architectures=["GPT2LMHeadModel"], model_type="gpt2")
    with pytest.raises(ValueError, match="GPT2LMHeadModel") as info:
        HFModelConfig.from_hf_dir(path)
    assert "LlamaForCausalLM" in str(info.value) and "Qwen3ForCausalLM" in str(info.value)


def test_sliding_window_is_refused(tmp_path):
    path = _write_config(tmp_path / "mistral", architectures=["MistralForCausalLM"], sliding_window=128)
    with pytest.raises(ValueError, match=r"sliding_window=128 .*max_position_embeddings=2048"):
        load_model(path)
    # A window as long as the context is plain causal attention.
    config = HFModelConfig.from_hf_dict({**json.loads((path / "config.json").read_text()), "sliding_window": 2048})
    assert config.family == "mistral"


def test_legacy_rope_fields_and_generation_eos(tmp_path):
    hf = json.loads((tiny_model_dir("llama") / "config.json").read_text())
    del hf["rope_parameters"]
    hf["rope_theta"] = 500000.0
    hf["rope_scaling"] = {"type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                          "original_max_position_embeddings": 8192}  # fmt: skip
    config = HFModelConfig.from_hf_dict(hf, extra_eos_token_ids=[7, 2, 9])
    assert config.rope_theta == 500000.0
    assert config.rope_scaling["rope_type"] == "llama3" and config.rope_scaling["factor"] == 8.0
    assert config.eos_token_ids == [2, 7, 9]
    assert HFModelConfig.from_hf_dir(tiny_model_dir("llama")).eos_token_ids == [EOS_ID, IM_END_ID]


def test_family_specifics_are_parsed():
    qwen3 = HFModelConfig.from_hf_dir(tiny_model_dir("qwen3"))
    qwen2 = HFModelConfig.from_hf_dir(tiny_model_dir("qwen2"))
    llama = HFModelConfig.from_hf_dir(tiny_model_dir("llama"))
    assert (qwen3.qk_norm, qwen3.attention_bias, qwen3.head_dim) == (True, False, 16)
    assert (qwen2.qk_norm, qwen2.attention_bias) == (False, True)
    assert llama.rope_scaling["rope_type"] == "llama3" and llama.max_position_embeddings >= 1024
    assert (llama.num_layers, llama.num_heads, llama.num_kv_heads, llama.hidden_size) == (2, 4, 2, 64)


def test_dtype_choice():
    model, _ = load_model(tiny_model_dir("mistral"), dtype="bfloat16")
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    default, _ = load_model(tiny_model_dir("mistral"))
    assert {p.dtype for p in default.parameters()} == {torch.float32}
    with pytest.raises(ValueError, match="int8"):
        load_model(tiny_model_dir("mistral"), dtype="int8")


@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2", "qwen3"])
def test_small_has_about_57m_parameters(family):
    hf_config = build_config(family, "small")
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hf_config)
    num_params = sum(p.numel() for p in model.parameters())
    # embed + head 2 * 32000 * 512, 8 layers of (q, o 512^2; k, v 512 * 128; MLP 3 * 512 * 1536)
    expected = 2 * 32000 * 512 + 8 * (2 * 512 * 512 + 2 * 512 * 128 + 3 * 512 * 1536)
    assert abs(num_params - expected) < 20_000, (num_params, expected)  # norms and qwen2 biases
    assert 56e6 < num_params < 58e6
    assert hf_config.head_dim == 64


def test_tiny_tokenizer_round_trips_and_matches_config():
    path = tiny_model_dir("llama")
    tokenizer = AutoTokenizer.from_pretrained(path)
    hf = json.loads((path / "config.json").read_text())
    text = "The quick model answers 42 questions, then streams tokens!\nNew line: ünïcode too."
    ids = tokenizer(text).input_ids
    assert max(ids) < hf["vocab_size"] and len(tokenizer) <= hf["vocab_size"]
    assert tokenizer.decode(ids) == text
    assert (tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id) == (BOS_ID, EOS_ID, PAD_ID)
    messages = [{"role": "user", "content": "hi"}]
    chat = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert chat == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def test_small_tokenizer_covers_the_vocab():
    """Every id the model can emit decodes to text (the BPE runs out of merges before 32000)."""
    tokenizer = build_tokenizer(32000)
    text = "Prefill and decode workers share one cache of 1024 blocks."
    ids = tokenizer(text).input_ids
    assert len(tokenizer) == 32000 and max(ids) < 32000
    assert tokenizer.decode(ids) == text
    assert tokenizer.decode([31999]) == " w31999"
    assert all(tokenizer.decode([i]) for i in range(len(SPECIAL_TOKENS), 32000, 97))
    # A filler streams like any word: it round-trips through encode as the same id.
    assert tokenizer(" w31999 w5000").input_ids == [31999, 5000]


def test_make_model_is_deterministic_per_seed(tmp_path):
    assert main(["--family", "qwen3", "--size", "tiny", "--out", str(tmp_path / "a")]) == 0
    make_model("qwen3", "tiny", tmp_path / "b", seed=0)
    make_model("qwen3", "tiny", tmp_path / "c", seed=1)
    a, b, c = (load_file(str(tmp_path / d / "model.safetensors")) for d in "abc")
    assert all(torch.equal(a[name], b[name]) for name in a)
    assert not torch.equal(a["model.layers.0.mlp.up_proj.weight"], c["model.layers.0.mlp.up_proj.weight"])
    assert (tmp_path / "a" / "tokenizer.json").read_bytes() == (tmp_path / "b" / "tokenizer.json").read_bytes()
