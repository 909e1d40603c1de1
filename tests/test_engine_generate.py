"""The engine end to end: greedy tokens equal transformers' generate for every family, block size and
prefill chunk size; prefix-cache reuse is real (counted) and changes nothing; bad input is refused by
name. Every scenario ends with the block manager's leak/integrity check."""

from __future__ import annotations

import functools

import pytest
import torch
from transformers import AutoModelForCausalLM

from engine.llm import LLM
from engine.sampling.params import SamplingError, SamplingParams
from tests.invariants import assert_no_leak
from tests.model_factory import tiny_model_dir

FAMILIES = ["llama", "mistral", "qwen2", "qwen3"]
PROMPT_LENGTHS = [1, 5, 37, 300, 16, 64, 8, 129]  # mixed, incl. exact block multiples and a 1-token prompt
NEW_TOKENS = 32
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)


def random_prompts(lengths: list[int], vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(5, vocab, (n,), generator=g).tolist() for n in lengths]  # avoid special ids


@functools.cache
def hf_greedy(family: str) -> tuple[list[list[int]], list[list[int]]]:
    """(prompts, transformers' greedy continuations), one request at a time, EOS disabled."""
    path = tiny_model_dir(family)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()
    hf.generation_config.eos_token_id = None  # run exactly NEW_TOKENS, like ignore_eos
    prompts = random_prompts(PROMPT_LENGTHS, hf.config.vocab_size, seed=1)
    outputs = []
    for prompt in prompts:
        ids = torch.tensor([prompt])
        out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS, do_sample=False)
        outputs.append(out[0, len(prompt) :].tolist())
    return prompts, outputs


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("block_size,chunk", [(8, 7), (16, 7), (8, 64), (16, 64), (8, 4096), (16, 4096)])
def test_greedy_batch_equals_transformers(family: str, block_size: int, chunk: int) -> None:
    prompts, expected = hf_greedy(family)
    llm = LLM(
        str(tiny_model_dir(family)),
        block_size=block_size,
        prefill_chunk_size=chunk,
        max_num_batched_tokens=max(chunk, 256),
        kv_cache_memory_mb=8,
    )
    outputs = llm.generate(prompts, GREEDY)
    got = [o.outputs[0].token_ids for o in outputs]
    for i, (g, e) in enumerate(zip(got, expected)):
        assert g == e, (
            f"prompt {i} ({len(prompts[i])} tokens) diverges at token {next(j for j in range(len(e)) if g[j] != e[j])}"
        )
    assert all(o.outputs[0].finish_reason == "length" for o in outputs)
    assert_no_leak(llm.engine.block_manager)


def test_logit_bias_greedy_equals_transformers_sequence_bias() -> None:
    prompts, plain = hf_greedy("mistral")
    path = tiny_model_dir("mistral")
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()
    hf.generation_config.eos_token_id = None
    # Per prompt: ban its plain greedy first and fifth tokens, favour two others (single-token sequence bias
    # in transformers is exactly a logit bias).
    biases = [{out[0]: -100.0, out[4]: -100.0, 11: 2.5, 700: 4.0} for out in plain[:4]]
    expected = []
    for prompt, bias in zip(prompts[:4], biases):
        ids = torch.tensor([prompt])
        out = hf.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=NEW_TOKENS,
            do_sample=False,
            sequence_bias=[[[t], b] for t, b in bias.items()],
        )
        expected.append(out[0, len(prompt) :].tolist())
    llm = LLM(str(path), block_size=8, prefill_chunk_size=64)
    outputs = llm.generate(
        prompts[:4],
        [SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True, logit_bias=b) for b in biases],
    )
    assert [o.outputs[0].token_ids for o in outputs] == expected
    assert all(e != p and p[0] not in e for e, p in zip(expected, plain))  # the bias changed every output
    assert_no_leak(llm.engine.block_manager)


def test_preemption_under_a_tiny_pool_keeps_outputs_exact() -> None:
    prompts, expected = hf_greedy("llama")
    # 48 blocks of 8 tokens: the 300-token prompt alone needs 42 of them, so decode steps preempt.
    llm = LLM(str(tiny_model_dir("llama")), block_size=8, num_kv_blocks=48, max_num_seqs=8)
    pool_blocks = llm.engine.block_manager.num_blocks
    assert pool_blocks * 8 < sum(len(p) + NEW_TOKENS for p in prompts), "pool must be too small for all at once"
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY)]
    assert got == expected
    assert llm.engine.scheduler.num_preemptions > 0
    assert_no_leak(llm.engine.block_manager)


def test_prefix_cache_computes_only_the_uncached_suffix() -> None:
    path = str(tiny_model_dir("qwen2"))
    shared, first_tail, second_tail = random_prompts([96, 4, 20], 768, seed=7)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)

    llm = LLM(path, block_size=16)
    llm.generate([shared + first_tail], params)
    before = llm.engine.num_computed_tokens
    [second] = llm.generate([shared + second_tail], params)
    computed = llm.engine.num_computed_tokens - before
    # 96 shared tokens = 6 full blocks come from the cache; the 20-token suffix and 7 decode steps run.
    assert second.num_cached_tokens == 96
    assert computed == 20 + (8 - 1)
    assert llm.engine.block_manager.num_prefix_hit_tokens == 96

    cold = LLM(path, block_size=16, enable_prefix_caching=False)
    [reference] = cold.generate([shared + second_tail], params)
    assert reference.num_cached_tokens == 0
    assert second.outputs[0].token_ids == reference.outputs[0].token_ids
    assert_no_leak(llm.engine.block_manager)
    assert_no_leak(cold.engine.block_manager)


@functools.cache
def hf_prompt_logprobs(family: str, prompts: tuple[tuple[int, ...], ...]) -> list[torch.Tensor]:
    """transformers' log-softmax over the vocabulary at every prompt position but the last, per prompt."""
    hf = AutoModelForCausalLM.from_pretrained(
        tiny_model_dir(family), dtype=torch.float32, attn_implementation="eager"
    ).eval()
    with torch.no_grad():
        return [hf(torch.tensor([p])).logits[0, :-1].float().log_softmax(-1) for p in prompts]


@pytest.mark.parametrize("chunk", [7, 4096])
def test_prompt_logprobs_equal_transformers_and_bypass_the_prefix_cache(chunk: int) -> None:
    path = str(tiny_model_dir("qwen3"))
    shared, tail_a, tail_b = random_prompts([48, 9, 30], 768, seed=11)
    prompts = (tuple(shared + tail_a), tuple(shared + tail_b), (5,))
    expected = hf_prompt_logprobs("qwen3", prompts)
    llm = LLM(path, block_size=8, prefill_chunk_size=chunk, max_num_batched_tokens=max(chunk, 64))
    llm.generate([list(prompts[0])], SamplingParams(temperature=0.0, max_tokens=2))  # caches the shared prefix
    before = llm.engine.num_computed_tokens
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True, prompt_logprobs=4)
    outs = llm.generate([list(p) for p in prompts], params)
    # Every prompt computed in full despite the 48 cached tokens: cached tokens have no logits.
    assert llm.engine.num_computed_tokens - before == sum(map(len, prompts)) + 3 * (3 - 1)
    for prompt, out, ref in zip(prompts, outs, expected):
        assert out.num_cached_tokens == 0
        assert len(out.prompt_logprobs) == len(prompt) and out.prompt_logprobs[0] is None
        for p, entry in enumerate(out.prompt_logprobs[1:]):
            row, token = ref[p], prompt[p + 1]
            assert entry.token_id == token
            assert abs(entry.logprob - row[token].item()) < 1e-4
            assert entry.rank == int((row > row[token]).sum()) + 1
            top = row.topk(4)
            assert [t for t, _ in entry.top] == top.indices.tolist()
            assert max(abs(lp - v) for (_, lp), v in zip(entry.top, top.values.tolist())) < 1e-4
    plain = llm.generate([list(prompts[1])], SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True))[0]
    assert plain.prompt_logprobs is None and plain.outputs[0].token_ids == outs[1].outputs[0].token_ids
    assert_no_leak(llm.engine.block_manager)


def test_prompt_logprobs_survive_preemption() -> None:
    prompts, expected = hf_greedy("llama")
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True, prompt_logprobs=1)
    roomy = LLM(str(tiny_model_dir("llama")), block_size=8).generate(prompts, params)
    tight = LLM(str(tiny_model_dir("llama")), block_size=8, num_kv_blocks=48, max_num_seqs=8)
    got = tight.generate(prompts, params)
    assert tight.engine.scheduler.num_preemptions > 0
    assert [o.outputs[0].token_ids for o in got] == expected
    for a, b, prompt in zip(got, roomy, prompts):
        assert len(a.prompt_logprobs) == len(prompt)
        assert [e.token_id for e in a.prompt_logprobs[1:]] == prompt[1:]
        assert [e.logprob for e in a.prompt_logprobs[1:]] == pytest.approx(
            [e.logprob for e in b.prompt_logprobs[1:]], abs=1e-5
        )
    assert_no_leak(tight.engine.block_manager)


def test_n_completions_share_the_prompt_and_seeds_reproduce() -> None:
    path = str(tiny_model_dir("llama"))
    [prompt] = random_prompts([40], 768, seed=3)
    llm = LLM(path, block_size=8)
    greedy = llm.generate([prompt], SamplingParams(n=3, temperature=0.0, max_tokens=12, ignore_eos=True))[0]
    single = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))[0]
    assert [c.index for c in greedy.outputs] == [0, 1, 2]
    assert all(c.token_ids == single.outputs[0].token_ids for c in greedy.outputs)

    sampled = SamplingParams(n=3, temperature=1.0, seed=1234, max_tokens=12, ignore_eos=True)
    first = llm.generate([prompt], sampled)[0]
    again = LLM(path, block_size=16).generate([prompt], sampled)[0]
    assert [c.token_ids for c in first.outputs] == [c.token_ids for c in again.outputs]
    assert len({tuple(c.token_ids) for c in first.outputs}) > 1, "completions of one seeded request must differ"
    assert_no_leak(llm.engine.block_manager)


def test_stop_token_ids_end_generation_and_are_kept() -> None:
    prompts, expected = hf_greedy("mistral")
    stop = expected[3][5]  # the 6th greedy token of prompt 3
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, stop_token_ids=[stop], ignore_eos=True)
    [out] = LLM(str(tiny_model_dir("mistral"))).generate([prompts[3]], params)
    first_stop = expected[3].index(stop)
    assert out.outputs[0].token_ids == expected[3][: first_stop + 1]
    assert out.outputs[0].finish_reason == "stop"


def test_prompt_longer_than_context_names_both_numbers() -> None:
    llm = LLM(str(tiny_model_dir("llama")))
    context = llm.engine.scheduler.config.max_model_len
    with pytest.raises(ValueError, match=rf"prompt has {context + 5} tokens; this model's context is {context}"):
        llm.generate([[7] * (context + 5)], GREEDY)
    assert not llm.engine.has_unfinished()
    assert_no_leak(llm.engine.block_manager)


@pytest.mark.parametrize(
    "field,value",
    [
        ("temperature", -0.5),
        ("top_p", 1.5),
        ("top_k", -3),
        ("min_p", 2.0),
        ("presence_penalty", 3.0),
        ("repetition_penalty", 0.0),
        ("max_tokens", 0),
        ("repetition_penalty", 1e-10),
        ("prompt_logprobs", 21),
        ("prompt_logprobs", -1),
    ],
)
def test_out_of_range_sampling_value_names_the_parameter(field: str, value: float) -> None:
    with pytest.raises(SamplingError, match=rf"^{field} must be .*got {value}"):
        SamplingParams(**{field: value})


def test_token_id_outside_vocabulary_is_refused() -> None:
    llm = LLM(str(tiny_model_dir("qwen3")))
    with pytest.raises(ValueError, match="token id 99999 is outside this model's vocabulary of 768 tokens"):
        llm.generate([[5, 99999]], GREEDY)
    with pytest.raises(ValueError, match="logit_bias token id 768 is outside this model's vocabulary of 768 tokens"):
        llm.generate([[5, 6]], SamplingParams(temperature=0.0, logit_bias={767: 1.0, 768: 1.0}))
    assert_no_leak(llm.engine.block_manager)
