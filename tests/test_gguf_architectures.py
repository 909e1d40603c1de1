"""GGUF files of every architecture pdserve runs, written in the test from tiny random checkpoints as
llama.cpp writes them (tests/gguf_factory.py): the engine loaded from the file generates exactly
transformers' greedy tokens (F32 against the HF checkpoint itself; Q8_0 against transformers' own GGUF
loader on the same file). A file that cannot be served is one line of error and exit 78."""

from __future__ import annotations

import os
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, GGUFWriter
from transformers import AutoConfig, AutoModelForCausalLM
from transformers.modeling_gguf_pytorch_utils import TensorProcessor, get_gguf_hf_weights_map

from configs.schema import EX_CONFIG
from engine.llm import LLM
from engine.model.gguf_tensors import gguf_name, unpermute_rows
from engine.model.loader import load_model
from engine.quant.apply import PROJECTIONS, dequantize, quantized_modules
from engine.sampling.params import SamplingParams
from tests.gguf_factory import _ARCH, SMOLLM2_GGUF, _permute, dequantizing, write_gguf
from tests.invariants import assert_no_leak
from tests.model_factory import tiny_model_dir

PROMPTS = [[5, 6, 7, 8, 9, 10], list(range(20, 60)), [300]]
GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)


def hf_greedy(hf) -> list[list[int]]:
    hf.generation_config.eos_token_id = None  # exactly max_tokens, like ignore_eos
    out = []
    for prompt in PROMPTS:
        ids = torch.tensor([prompt])
        tokens = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=16, do_sample=False)
        out.append(tokens[0, len(prompt) :].tolist())
    return out


def engine_greedy(gguf_file: Path) -> list[list[int]]:
    with dequantizing():
        llm = LLM(str(gguf_file), kv_cache_memory_mb=8)
    got = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)]
    assert_no_leak(llm.engine.block_manager)
    return got


def test_unpermute_inverts_llama_cpp_row_order() -> None:
    w = np.arange(48 * 3, dtype=np.float32).reshape(48, 3)  # 3 heads of 16 rows
    back = torch.from_numpy(_permute(w, 3))[unpermute_rows(48, 3)]
    assert torch.equal(back, torch.from_numpy(w))


@pytest.mark.parametrize("family", ["mistral", "qwen2", "qwen3"])
def test_gguf_names_are_transformers_gguf_names(family: str) -> None:
    """The loader's name map (which tests/gguf_factory.py writes files with) against transformers' own:
    every weight of the checkpoint, named as transformers' GGUF loader looks it up for the architecture
    llama.cpp writes (Mistral as ``llama``)."""
    hf = AutoModelForCausalLM.from_pretrained(tiny_model_dir(family), dtype=torch.float32)
    theirs = get_gguf_hf_weights_map(hf, TensorProcessor(), model_type=_ARCH[family][0])  # GGUF name -> HF name
    ours = {gguf_name(name): name for name in hf.state_dict()}
    assert ours == {g: h for g, h in theirs.items() if h in hf.state_dict()}


@pytest.mark.parametrize("family", ["mistral", "qwen2", "qwen3"])
def test_f32_gguf_equals_transformers_on_the_checkpoint(family: str, tmp_path: Path) -> None:
    hf_dir = tiny_model_dir(family)
    gguf_file = write_gguf(hf_dir, family, tmp_path / f"{family}.gguf")
    expected = hf_greedy(AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval())
    assert engine_greedy(gguf_file) == expected


@pytest.mark.parametrize("family", ["mistral", "qwen2", "qwen3"])
def test_q8_0_gguf_equals_transformers_gguf_loader(family: str, tmp_path: Path) -> None:
    hf_dir = tiny_model_dir(family)
    gguf_file = write_gguf(hf_dir, family, tmp_path / f"{family}.gguf", GGMLQuantizationType.Q8_0)
    # transformers' GGUF config mapping reads no head_dim for qwen3 (it assumes 128), so there the config
    # comes from the source checkpoint; the weights are always transformers' own dequantization of the file
    config = AutoConfig.from_pretrained(hf_dir) if family == "qwen3" else None
    hf = AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file=gguf_file.name, config=config, dtype=torch.float32)
    assert engine_greedy(gguf_file) == hf_greedy(hf.eval())


@pytest.mark.parametrize("family", ["mistral", "qwen3"])
def test_q8_0_gguf_kept_quantized_holds_the_dequantized_weights(family: str, tmp_path: Path) -> None:
    """The file's Q8_0 rows go to the quantized kernels (engine/model/gguf_quant.py), fused and, for llama,
    q/k unpermuted as rows of blocks: each projection's record decodes to exactly the float weight the
    dequantizing path loads. (The kernels' products themselves: tests/test_quant_*.py.)"""
    gguf_file = write_gguf(tiny_model_dir(family), family, tmp_path / f"{family}.gguf", GGMLQuantizationType.Q8_0)
    quant = load_model(gguf_file)[0]
    with dequantizing():
        plain = load_model(gguf_file)[0]
    assert len(quantized_modules(quant)) == 4 * len(quant.layers) + 1  # every projection of every layer, the head
    for quant_layer, plain_layer in zip(quant.layers, plain.layers):
        for path in PROJECTIONS:
            record = quant_layer.get_submodule(path).qweight
            assert torch.equal(dequantize(record), plain_layer.get_submodule(path).weight), path
    # the LM head in the file's format too (output, or token_embd when tied), as llama.cpp runs it
    assert plain.quantized_head is None
    assert torch.equal(dequantize(quant.quantized_head.qweight), plain.lm_head)


def run_generate(model: Path, home: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "HOME": str(home)}  # the materialised directory goes to a fresh cache
    cmd = [sys.executable, "-m", "cluster", "generate", "--model", str(model), "--max-tokens", "1", "--prompt", "hi"]
    return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)


def assert_one_line_exit_78(result: subprocess.CompletedProcess, words: str) -> None:
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert result.returncode == EX_CONFIG, result.stderr
    assert len(lines) == 1 and words in lines[0], lines


def test_not_a_gguf_is_one_line_and_exit_78(tmp_path: Path) -> None:
    bad = tmp_path / "model.gguf"
    bad.write_text("this is not a model\n")
    assert_one_line_exit_78(run_generate(bad, tmp_path), "not a GGUF file")


def test_truncated_gguf_is_one_line_and_exit_78(tmp_path: Path) -> None:
    cut = tmp_path / "cut.gguf"
    with SMOLLM2_GGUF.open("rb") as src, cut.open("wb") as dst:
        dst.write(src.read(SMOLLM2_GGUF.stat().st_size // 2))
    assert_one_line_exit_78(run_generate(cut, tmp_path), "truncated or corrupt")


def test_unknown_architecture_is_one_line_and_exit_78(tmp_path: Path) -> None:
    path = tmp_path / "gpt2.gguf"
    writer = GGUFWriter(path, "gpt2")
    writer.add_tensor("token_embd.weight", np.zeros((8, 4), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    assert_one_line_exit_78(run_generate(tmp_path, tmp_path), "unsupported architecture 'gpt2'")


def test_unknown_tensor_type_is_one_line_and_exit_78(tmp_path: Path) -> None:
    path = write_gguf(tiny_model_dir("qwen2"), "qwen2", tmp_path / "q.gguf")
    data = bytearray(path.read_bytes())
    # token_embd's tensor info: its ggml type (after the name, n_dims and dims) set to an id ggml does not define
    name_at = data.index(b"token_embd.weight")
    name_len = struct.unpack_from("<Q", data, name_at - 8)[0]
    n_dims = struct.unpack_from("<I", data, name_at + name_len)[0]
    struct.pack_into("<I", data, name_at + name_len + 4 + 8 * n_dims, 250)
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(bytes(data))
    assert_one_line_exit_78(run_generate(bad, tmp_path), "not a readable GGUF file")
