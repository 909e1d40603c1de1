"""LoRA adapters changing under traffic, in the engine: a running request keeps the weights it was
admitted with through an unload, an LRU eviction from host memory and a rewrite of its directory (its
tokens are PEFT's for those weights); a re-read that finds rewritten files is refused by name; loading
the rewritten directory again serves the new weights and reuses none of the old ones' KV."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from engine.llm import LLM
from tests.invariants import assert_no_leak
from tests.lora_factory import peft_greedy, tiny_adapter_dir
from tests.model_factory import tiny_model_dir
from tests.test_lora_engine import FAMILY, NEW_TOKENS, greedy, prompts

FILES = ("adapter_config.json", "adapter_model.safetensors")


def copy_of(name: str, into: Path) -> Path:
    out = into / f"copy-of-{name}"
    shutil.copytree(tiny_adapter_dir(name, FAMILY), out)
    return out


def rewrite_in_place(path: Path, with_files_of: str) -> None:
    """The same directory and file names, another adapter's bytes (opened for writing, not replaced)."""
    for file in FILES:
        (path / file).write_bytes((tiny_adapter_dir(with_files_of, FAMILY) / file).read_bytes())


def engine_with(modules: list[str], **limits) -> LLM:
    settings = dict(block_size=8, prefill_chunk_size=16, kv_cache_memory_mb=8, enable_lora=True, max_lora_rank=8)
    return LLM(str(tiny_model_dir(FAMILY)), lora_modules=modules, **(settings | limits))


def run_to_end(engine) -> dict[int, list[int]]:
    done = {}
    while engine.has_unfinished():
        done |= {o.request_id: o.outputs[0].token_ids for o in engine.step()}
    return done


def test_a_running_request_keeps_its_weights_through_unload_eviction_and_rewrite(tmp_path) -> None:
    alpha = copy_of("alpha", tmp_path)
    llm = engine_with([f"alpha={alpha}", f"beta={tiny_adapter_dir('beta', FAMILY)}"], max_loras=1, max_cpu_loras=1)
    engine, manager = llm.engine, llm.engine.runner.lora
    ps = prompts()
    expected = {n: peft_greedy(FAMILY, n, ps[:2], NEW_TOKENS) for n in ("alpha", "beta")}
    first = engine.add_request(ps[0], greedy("alpha"))
    engine.step()  # running under alpha
    rewrite_in_place(alpha, "beta")  # a re-read of alpha's directory would now give beta's weights
    second = engine.add_request(ps[1], greedy("beta"))  # beta takes the one host copy: alpha evicted
    assert manager.host_names == ["beta"]
    engine.step()
    assert manager.remove("alpha")  # and unloaded, with its request still running
    assert run_to_end(engine) == {first: expected["alpha"][0], second: expected["beta"][1]}
    assert_no_leak(engine.block_manager)


def test_a_reread_that_finds_the_files_rewritten_is_refused_by_name(tmp_path) -> None:
    alpha = copy_of("alpha", tmp_path)
    llm = engine_with([f"alpha={alpha}", f"beta={tiny_adapter_dir('beta', FAMILY)}"], max_loras=1, max_cpu_loras=1)
    ps = prompts()
    llm.generate(ps[:1], greedy("beta"))  # alpha out of host memory: the next request re-reads it
    rewrite_in_place(alpha, "beta")
    with pytest.raises(ValueError, match=rf"LoRA adapter 'alpha': its files in {alpha} changed since it was loaded"):
        llm.engine.add_request(ps[0], greedy("alpha"))
    served = llm.generate(ps[:1], greedy("beta"))[0].outputs[0].token_ids
    assert served == peft_greedy(FAMILY, "beta", ps[:1], NEW_TOKENS)[0]  # the other adapter serves on


def test_loading_a_rewritten_directory_again_serves_the_new_weights_and_none_of_the_old_kv(tmp_path) -> None:
    path = copy_of("alpha", tmp_path)
    llm = engine_with([f"zeta={path}"], max_loras=1)
    manager = llm.engine.runner.lora
    prompt = prompts()[1]  # 37 tokens: 4 full blocks of 8
    first = llm.generate([prompt], greedy("zeta"))[0]
    assert first.outputs[0].token_ids == peft_greedy(FAMILY, "alpha", [prompt], NEW_TOKENS)[0]
    assert llm.generate([prompt], greedy("zeta"))[0].num_cached_tokens == 32  # its own KV, reused
    assert not manager.add("zeta", str(path))  # the same files: nothing read again
    rewrite_in_place(path, "beta")
    assert manager.add("zeta", str(path))  # loaded again: same name, same directory, other bytes
    again = llm.generate([prompt], greedy("zeta"))[0]
    assert again.num_cached_tokens == 0  # the old weights' KV is another identity's
    assert again.outputs[0].token_ids == peft_greedy(FAMILY, "beta", [prompt], NEW_TOKENS)[0]
    assert_no_leak(llm.engine.block_manager)
