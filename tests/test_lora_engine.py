"""LoRA in the engine: adapters and the base in one batch give PEFT's greedy tokens; the device slots
page adapters LRU without refusing a request; the prefix cache is never shared across adapters; bad
adapters are refused by name."""

from __future__ import annotations

import dataclasses
import json
import shutil
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine.llm import LLM
from engine.lora.adapter import LoRAError, load_adapter
from engine.model.config import HFModelConfig
from engine.sampling.params import SamplingParams
from tests.invariants import assert_no_leak
from tests.lora_factory import peft_greedy, tiny_adapter_dir
from tests.model_factory import _root, tiny_model_dir

FAMILY = "llama"
NEW_TOKENS = 12
LENGTHS = [5, 37, 16, 9]


def prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(3)
    return [torch.randint(5, 700, (n,), generator=g).tolist() for n in LENGTHS]


def greedy(lora_name: str = "") -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True, lora_name=lora_name)


def lora_llm(**overrides) -> LLM:
    modules = [f"{n}={tiny_adapter_dir(n, FAMILY)}" for n in ("alpha", "beta")]
    settings = dict(
        block_size=8,
        prefill_chunk_size=16,
        kv_cache_memory_mb=8,
        enable_lora=True,
        lora_modules=modules,
        max_loras=2,
        max_lora_rank=8,
    )
    return LLM(str(tiny_model_dir(FAMILY)), **(settings | overrides))


@pytest.mark.parametrize("max_loras", [2, 1])  # 1: the two adapters share one slot (paged, LRU)
def test_adapters_and_base_in_one_batch_equal_peft(max_loras: int) -> None:
    ps = prompts()
    names = ["", "alpha", "beta"]
    expected = {n: peft_greedy(FAMILY, n, ps, NEW_TOKENS) for n in names}
    assert expected["alpha"] != expected[""] and expected["beta"] != expected[""]  # the adapters matter
    llm = lora_llm(max_loras=max_loras, max_cpu_loras=max_loras)
    jobs = [(n, i) for i in range(len(ps)) for n in names]  # interleaved: every step mixes all three
    outputs = llm.generate([ps[i] for _, i in jobs], [greedy(n) for n, _ in jobs])
    for (name, i), out in zip(jobs, outputs):
        assert out.outputs[0].token_ids == expected[name][i], f"adapter {name!r} prompt {i}"
    manager = llm.engine.runner.lora
    assert len(manager.slot_names) <= max_loras and len(manager.host_names) <= max_loras
    if max_loras == 1:  # two adapters in every step, one slot and one host copy: paged from disk, never refused
        assert manager.num_host_loads > 2


def test_an_adapter_unloaded_mid_request_lets_its_running_requests_finish() -> None:
    llm = lora_llm()
    ps = prompts()
    expected = peft_greedy(FAMILY, "alpha", ps[:1], NEW_TOKENS)[0]
    request_id = llm.engine.add_request(ps[0], greedy("alpha"))
    llm.engine.step()  # running under alpha
    assert llm.engine.runner.lora.remove("alpha")
    with pytest.raises(ValueError, match="'alpha' is not loaded"):  # new requests refused at once
        llm.engine.add_request(ps[1], greedy("alpha"))
    done = []
    while llm.engine.has_unfinished():
        done += llm.engine.step()
    assert [(o.request_id, o.outputs[0].token_ids) for o in done] == [(request_id, expected)]
    assert_no_leak(llm.engine.block_manager)


def test_prefix_cache_is_not_shared_across_adapters() -> None:
    llm = lora_llm()
    prompt = prompts()[1]  # 37 tokens: 4 full blocks of 8
    first = {n: llm.generate([prompt], greedy(n))[0] for n in ("", "alpha", "beta")}
    assert all(out.num_cached_tokens == 0 for out in first.values())
    again = {n: llm.generate([prompt], greedy(n))[0] for n in ("", "alpha", "beta")}
    for name in again:  # each reuses its own KV only, and gives the same tokens from it
        assert again[name].num_cached_tokens == 32, name
        assert again[name].outputs[0].token_ids == first[name].outputs[0].token_ids
    assert_no_leak(llm.engine.block_manager)


def test_unknown_adapter_in_a_request_is_refused_by_name() -> None:
    llm = lora_llm()
    with pytest.raises(ValueError, match="'gamma' is not loaded"):
        llm.engine.add_request([5, 6, 7], greedy("gamma"))
    plain = LLM(str(tiny_model_dir(FAMILY)), block_size=8, kv_cache_memory_mb=8)
    with pytest.raises(ValueError, match="serves no adapters"):
        plain.engine.add_request([5, 6, 7], greedy("alpha"))


def broken_copy(name: str, edit) -> str:
    """A copy of adapter ``name`` with ``edit(config dict, tensors dict)`` applied."""
    src = tiny_adapter_dir(name, FAMILY)
    out = _root() / f"broken-{name}-{edit.__name__}"
    shutil.rmtree(out, ignore_errors=True)
    shutil.copytree(src, out)
    config = json.loads((out / "adapter_config.json").read_text())
    tensors = load_file(out / "adapter_model.safetensors")
    edit(config, tensors)
    (out / "adapter_config.json").write_text(json.dumps(config))
    save_file(tensors, out / "adapter_model.safetensors")
    return str(out)


def wrong_shape(config, tensors):
    key = next(k for k in tensors if "v_proj.lora_B" in k)
    tensors[key] = torch.zeros(tensors[key].shape[0] + 1, tensors[key].shape[1])


def unknown_module(config, tensors):
    key = next(k for k in tensors if "q_proj.lora_A" in k)
    tensors[key.replace("q_proj", "rotary_proj")] = tensors.pop(key)


def missing_half(config, tensors):
    tensors.pop(next(k for k in tensors if "down_proj.lora_B" in k))


@pytest.mark.parametrize("edit,message", [
    (wrong_shape, r"v_proj has lora_A \[4, 64\] and lora_B \[33, 4\]; this base model expects \[4, 64\] and \[32, 4\]"),
    (unknown_module, "tensor .*rotary_proj.* is not a LoRA weight of a projection this base model has"),
    (missing_half, "down_proj has lora_A but no lora_B"),
])  # fmt: skip
def test_adapter_that_does_not_fit_the_base_is_refused(edit, message) -> None:
    config = HFModelConfig.from_hf_dir(tiny_model_dir(FAMILY))
    with pytest.raises(LoRAError, match="LoRA adapter 'bad'.*" + message):
        load_adapter("bad", broken_copy("alpha", edit), config, max_rank=16)


def test_rank_above_the_maximum_and_missing_files_are_refused() -> None:
    config = HFModelConfig.from_hf_dir(tiny_model_dir(FAMILY))
    with pytest.raises(LoRAError, match="'beta' has rank 8, above max_lora_rank=4"):
        load_adapter("beta", tiny_adapter_dir("beta", FAMILY), config, max_rank=4)
    with pytest.raises(LoRAError, match="'gone': no adapter_config.json in /nonexistent"):
        load_adapter("gone", "/nonexistent", config, max_rank=16)
    other = dataclasses.replace(config, num_kv_heads=1)  # a base with another K/V width
    with pytest.raises(
        LoRAError,
        match=r"'other': layer 0 v_proj has lora_A \[4, 64\] and lora_B \[32, 4\]; "
        r"this base model expects \[4, 64\] and \[16, 4\]",
    ):
        load_adapter("other", tiny_adapter_dir("alpha", FAMILY), other, max_rank=16)


def test_pdserve_generate_runs_a_prompt_under_an_adapter_as_peft_does() -> None:
    from transformers import AutoTokenizer

    model = tiny_model_dir(FAMILY)
    tokenizer = AutoTokenizer.from_pretrained(model)
    prompt = "hello world, the adapter speaks"
    expected = peft_greedy(FAMILY, "beta", [tokenizer.encode(prompt)], NEW_TOKENS)[0]
    argv = [
        sys.executable,
        "-m",
        "cluster",
        "generate",
        "--model",
        str(model),
        "--prompt",
        prompt,
        "--max-tokens",
        str(NEW_TOKENS),
        "--ignore-eos",
        "--enable-lora",
        "--lora-modules",
        f"beta={tiny_adapter_dir('beta', FAMILY)}",
        "--max-lora-rank",
        "8",
        "--lora-name",
        "beta",
    ]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split("\n")[1:-1] == [
        tokenizer.decode(expected, skip_special_tokens=True)
    ]  # not splitlines: \x1e
    bad = subprocess.run(
        argv[:-4] + ["--max-lora-rank", "4", "--lora-name", "beta"], capture_output=True, text=True, timeout=300
    )
    assert bad.returncode == 78 and "LoRA adapter 'beta' has rank 8, above max_lora_rank=4" in bad.stderr


def test_a_worker_keeps_the_newest_stamped_list_whichever_gateway_sent_it() -> None:
    from engine.lora.sync import LoRASync
    from protocol.serving import LoRAAdapterSet

    manager = lora_llm().engine.runner.lora
    sync = LoRASync(manager)  # the config's alpha and beta, stamp (0, "")
    alpha, beta = manager.known["alpha"], manager.known["beta"]
    gamma = str(tiny_adapter_dir("alpha", FAMILY))
    assert sync.apply(LoRAAdapterSet(1, ["alpha", "beta", "gamma"], [alpha, beta, gamma], "g1"))
    assert sorted(manager.known) == ["alpha", "beta", "gamma"]
    # g2 made a change on top of the same version at the same time: the lower gateway id loses
    assert not sync.apply(LoRAAdapterSet(1, ["alpha"], [alpha], "g0"))
    assert sorted(manager.known) == ["alpha", "beta", "gamma"]
    # g2, having seen g1's list, unloads beta: a newer stamp, applied whoever loaded it
    assert sync.apply(LoRAAdapterSet(2, ["alpha", "gamma"], [alpha, gamma], "g2"))
    assert sorted(manager.known) == ["alpha", "gamma"]
    assert not sync.apply(LoRAAdapterSet(1, ["alpha", "beta", "gamma"], [alpha, beta, gamma], "g1"))  # late
    fields = sync.heartbeat_fields()
    assert (fields["lora_set_version"], fields["lora_set_gateway"]) == (2, "g2")
    assert (fields["lora_set_names"], fields["lora_set_paths"]) == (["alpha", "gamma"], [alpha, gamma])
    assert fields["lora_names"] == ["alpha", "gamma"]
    sync.apply(LoRAAdapterSet(3, ["alpha", "bad"], [alpha, "/nope"], "g1"))
    assert sync.heartbeat_fields()["lora_errors"] == ["bad: LoRA adapter 'bad': no adapter_config.json in /nope"]
    assert sync.heartbeat_fields()["lora_set_names"] == ["alpha", "bad"]  # the list held, as sent
