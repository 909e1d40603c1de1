"""Structured outputs in the engine: every output follows its grammar, checked by an independent parser
(Python's ``re``, ``json`` + ``jsonschema``); greedy tokens and logprobs equal transformers' logits
masked to the tokens a brute-force check over the vocabulary allows. Every test ends with the leak check."""

from __future__ import annotations

import functools
import json
import re

import jsonschema
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from engine.llm import LLM
from engine.sampling.params import SamplingParams
from engine.sampling.structured_output import StructuredOutputError
from protocol.serving import StructuredOutput
from tests.invariants import assert_no_leak
from tests.model_factory import tiny_model_dir

FAMILY = "llama"
PROMPTS = [[5, 9, 33, 70], [11, 12], list(range(20, 61))]
CHOICES = ["yes", "no thanks", "maybe later", "never"]
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 999},
        "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3},
    },
    "required": ["name", "age", "tags"],
    "additionalProperties": False,
}


@functools.cache
def llm(**overrides) -> LLM:
    return LLM(str(tiny_model_dir(FAMILY)), kv_cache_memory_mb=8, **overrides)


@functools.cache
def hf():
    path = tiny_model_dir(FAMILY)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()
    return model, AutoTokenizer.from_pretrained(path)


def choice(*options: str) -> StructuredOutput:
    return StructuredOutput("choice", json.dumps(list(options)))


def generate(spec: StructuredOutput, prompts=PROMPTS, engine: LLM | None = None, **params):
    engine = engine or llm()
    params = SamplingParams(**{"temperature": 0.0, "max_tokens": 64, "structured_output": spec, **params})
    outputs = engine.generate(prompts, params)
    assert_no_leak(engine.engine.block_manager)
    return outputs


def text_of(token_ids: list[int]) -> str:
    return hf()[1].decode(token_ids, skip_special_tokens=True)


def allowed_by_choices(done_text: str, eos_ids: set[int]) -> set[int]:
    """Brute force over the vocabulary: tokens whose text extends ``done_text`` toward one of CHOICES,
    plus EOS once ``done_text`` is one of them."""
    _, tok = hf()
    special = set(tok.all_special_ids)
    allowed = {
        t
        for t in range(len(tok))
        if t not in special and (piece := tok.decode([t])) and any(c.startswith(done_text + piece) for c in CHOICES)
    }
    return allowed | (eos_ids if done_text in CHOICES else set())


def test_greedy_choice_equals_transformers_masked_by_brute_force() -> None:
    model, _ = hf()
    eos = set(llm().engine.model_config.eos_token_ids)
    outputs = generate(choice(*CHOICES), logprobs=2)
    for prompt, out in zip(PROMPTS, outputs):
        completion = out.outputs[0]
        assert completion.finish_reason == "stop" and completion.token_ids[-1] in eos
        assert text_of(completion.token_ids) in CHOICES
        ids = list(prompt)
        for step, token in enumerate(completion.token_ids):
            with torch.no_grad():
                logits = model(torch.tensor([ids])).logits[0, -1]  # [V]
            allowed = sorted(allowed_by_choices(text_of(ids[len(prompt) :]), eos))
            masked = torch.full_like(logits, float("-inf"))
            masked[allowed] = logits[allowed]
            assert token == int(masked.argmax()), f"step {step}: allowed {len(allowed)} tokens"
            # Logprobs are those of the masked distribution (vLLM's order: the grammar first).
            expected = masked.log_softmax(dim=0)
            assert completion.logprobs[step].logprob == pytest.approx(float(expected[token]), abs=1e-4)
            assert [t for t, _ in completion.logprobs[step].top][:1] == [token]
            ids.append(token)


@pytest.mark.parametrize("pattern", [r"[a-z]{2,5}-\d{3}", r"(cat|dog)s? (and|or) \d{1,4}", r"0x[0-9a-f]{4}"])
def test_regex_outputs_match_python_re(pattern: str) -> None:
    for temperature in (0.0, 1.0):
        for out in generate(StructuredOutput("regex", pattern), temperature=temperature, seed=3, n=2):
            for completion in out.outputs:
                assert completion.finish_reason == "stop"
                assert re.fullmatch(pattern, text_of(completion.token_ids)), text_of(completion.token_ids)


def test_json_schema_outputs_validate() -> None:
    finished = 0
    for temperature in (0.0, 1.0):
        for out in generate(
            StructuredOutput("json", json.dumps(SCHEMA)), temperature=temperature, seed=5, max_tokens=200
        ):
            completion = out.outputs[0]
            text = text_of(completion.token_ids)
            if completion.finish_reason == "length":  # a random model may write a long name: a valid prefix
                assert text.startswith('{"name": "')
                continue
            jsonschema.validate(json.loads(text), SCHEMA)
            finished += 1
    assert finished >= 3


def test_json_object_output_is_an_object() -> None:
    for out in generate(StructuredOutput("json_object"), max_tokens=200, temperature=1.0, seed=1):
        completion = out.outputs[0]
        if completion.finish_reason == "stop":
            assert isinstance(json.loads(text_of(completion.token_ids)), dict)


def test_grammar_ends_the_output_even_with_ignore_eos_and_min_tokens() -> None:
    """The grammar's end is a stop, whatever ignore_eos says; min_tokens cannot hold back a grammar that
    allows nothing but its stop token (the sampler would be left with no token at all)."""
    for extra in (dict(ignore_eos=True), dict(min_tokens=20)):
        for out in generate(choice("yes"), **extra):
            completion = out.outputs[0]
            assert completion.finish_reason == "stop" and text_of(completion.token_ids) == "yes"


@pytest.mark.parametrize("end_at", [0, 2])
def test_a_gated_grammar_applies_from_the_token_after_the_end_text(end_at: int) -> None:
    """A reasoning gate (StructuredOutput.after): up to the token that completes the end text the output
    is the free greedy one; from the next token it is what the grammar gives with the free tokens as
    prompt. The end text here is what this random model writes itself (a thinking model's </think>), at
    its first token (sampled at prefill) or its third."""
    pattern = r"[a-z]{2,5}-\d{3}"
    for prompt in PROMPTS:
        free = llm().generate([prompt], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))[0].outputs[0]
        end = text_of(free.token_ids[end_at : end_at + 1])
        assert end
        cut = next(i for i in range(len(free.token_ids)) if end in text_of(free.token_ids[: i + 1]))
        gated = generate(StructuredOutput("regex", pattern, after=end), [prompt])[0].outputs[0].token_ids
        reference = generate(StructuredOutput("regex", pattern), [prompt + free.token_ids[: cut + 1]])
        assert gated[: cut + 1] == free.token_ids[: cut + 1]
        assert gated[cut + 1 :] == reference[0].outputs[0].token_ids
        assert re.fullmatch(pattern, text_of(gated[cut + 1 :]))


def test_a_reasoning_gate_opens_on_an_end_spelled_across_tokens_and_forks_with_its_state() -> None:
    tok = hf()[1]
    pieces = tok.encode("ok</think>", add_special_tokens=False)
    assert len(pieces) > 1  # this tokenizer has no </think> token: the end spans several tokens
    guide = llm().engine.grammars.guide(StructuredOutput("regex", "[0-9]+", after="</think>"))
    opened = []
    for i, token in enumerate(pieces):
        if i == len(pieces) - 1:
            twin = guide.fork()
        assert guide.accept(token)
        opened.append(guide.constrains)
    assert opened == [False] * (len(pieces) - 1) + [True] and not guide.is_ended
    digit, letter = tok.encode("7", add_special_tokens=False)[0], tok.encode("x", add_special_tokens=False)[0]
    assert not guide.accept(letter) and guide.accept(digit)  # the grammar holds from here
    assert not twin.constrains and twin.accept(letter)  # the fork, one token back, still reasons


def test_grammar_survives_preemption_and_forks_per_completion() -> None:
    """A pool so small that sequences are preempted and recomputed: each of n = 3 sampled completions
    still follows the grammar (its matcher kept its state, and forked ones are independent)."""
    tiny = LLM(str(tiny_model_dir(FAMILY)), num_kv_blocks=14, block_size=8, max_num_seqs=8)
    pattern = r"(ab|cd){3,6}!"
    outputs = generate(
        StructuredOutput("regex", pattern),
        prompts=[list(range(5, 40))] * 3,
        engine=tiny,
        temperature=1.0,
        seed=7,
        n=3,
        max_tokens=40,
    )
    assert tiny.engine.scheduler.num_preemptions > 0
    texts = [text_of(c.token_ids) for out in outputs for c in out.outputs]
    assert all(re.fullmatch(pattern, t) for t in texts), texts
    assert len(set(texts)) > 1  # the completions sampled apart


@pytest.mark.parametrize(
    "spec, message",
    [
        (StructuredOutput("json", '{"type": "nope"}'), 'invalid JSON schema: Unsupported type "nope"'),
        (StructuredOutput("json", "{"), "invalid JSON schema: Failed to parse JSON"),
        (StructuredOutput("regex", "a(b"), "invalid regex: Regex parsing error at position 4"),
        (
            StructuredOutput("grammar", "root ::= foo"),
            'invalid EBNF grammar: EBNF parser error at line 1, column 10: Rule "foo" is not defined',
        ),
        (StructuredOutput("choice", "[]"), "choice must be a non-empty list of non-empty strings"),
    ],
)
def test_a_bad_grammar_is_refused_by_name_and_nothing_is_queued(spec, message) -> None:
    engine = llm()
    with pytest.raises(StructuredOutputError, match=re.escape(message)):
        engine.generate([[5, 6, 7]], SamplingParams(max_tokens=4, structured_output=spec))
    assert not engine.engine.has_unfinished()
    assert_no_leak(engine.engine.block_manager)
