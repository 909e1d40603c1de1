"""The decode worker speculating (n-gram): a request's streamed tokens equal the plain engine's, vLLM's
spec_decode series on /metrics count the drafts the engine verified, the request's log line names its
acceptance, and nothing leaks."""

from __future__ import annotations

import dataclasses
import json
import logging
import re
import urllib.request

from engine.llm import LLM
from engine.sampling.params import SamplingParams
from tests.decode_harness import generate, scrape, tokens_of
from tests.invariants import assert_no_leak
from tests.test_decode_node import Running

SPEC = json.dumps(
    {
        "method": "ngram",
        "num_speculative_tokens": 3,
        "prompt_lookup_max": 2,
        "min_acceptance": 0.0,
        "verify_row_cost": 0.0,
    }
)
# A span said twice and begun again: lookups find proposals at once.
PROMPT = [5, 17, 99, 3, 250, 41, 7, 300, 12, 64] * 2 + [5, 17, 99]


def assert_streams_the_plain_output(node: Running) -> None:
    """Request r1 (PROMPT, greedy) through the speculating worker ``node`` streams the tokens the plain
    engine of the same config, speculation off, generates."""
    params = dict(max_tokens=24, temperature=0.0, ignore_eos=True)
    node.gateway.send("d0", generate("r1", PROMPT, **params))
    got = tokens_of(node.gateway.collect("r1")[0])
    plain = dataclasses.replace(node.config, engine=dataclasses.replace(node.config.engine, speculative_config=""))
    expected = LLM(node.config.model.path, config=plain).generate([PROMPT], SamplingParams(**params))[0]
    assert got == expected.outputs[0].token_ids


def test_decode_worker_speculates_exactly_and_reports_it(caplog) -> None:
    caplog.set_level(logging.INFO, logger="decode_node.server")
    node = Running(speculative_config=SPEC)
    try:
        assert_streams_the_plain_output(node)

        spec = node.node.server.scheduler.speculator
        port = node.node.http.port
        assert spec.num_draft_tokens > 0
        assert scrape(port, "vllm:spec_decode_num_drafts_total") == spec.num_drafts
        assert scrape(port, "vllm:spec_decode_num_draft_tokens_total") == spec.num_draft_tokens
        assert scrape(port, "vllm:spec_decode_num_accepted_tokens_total") == spec.num_accepted_tokens
        body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
        per_pos = {
            int(m.group(1)): float(m.group(2))
            for m in re.finditer(
                r'vllm:spec_decode_num_accepted_tokens_per_pos_total\{[^}]*position="(\d+)"[^}]*\} (\S+)', body
            )
        }
        assert per_pos == {i: float(v) for i, v in enumerate(spec.num_accepted_per_pos)}
        finished = [r.getMessage() for r in caplog.records if "rid=r1 finished" in r.getMessage()]
        assert finished and f"{spec.num_accepted_tokens}/{spec.num_draft_tokens} draft tokens accepted" in finished[0]
    finally:
        bm = node.close()
    assert_no_leak(bm)


def test_decode_worker_speculates_with_the_targets_first_layer_as_draft() -> None:
    """Across the split: the prefill worker's first token and KV arrive as with n-gram; the draft (the
    target's first layer, its own pool) catches up the prompt at the first decode step and drafts from
    there. The output is the plain engine's; the draft's pool ends with no block held."""
    draft = json.dumps(
        {
            "method": "draft_model",
            "model": "self:1",
            "num_speculative_tokens": 3,
            "min_acceptance": 0.0,
            "verify_row_cost": 0.0,
        }
    )
    node = Running(speculative_config=draft)
    try:
        assert_streams_the_plain_output(node)
        spec = node.node.server.scheduler.speculator
        assert spec.num_draft_tokens > 0 and spec.num_accepted_tokens > 0
        assert scrape(node.node.http.port, "vllm:spec_decode_num_draft_tokens_total") == spec.num_draft_tokens
        proposer = spec.proposer
    finally:
        bm = node.close()
    assert_no_leak(bm)
    assert proposer.num_shadows == 0
    assert_no_leak(proposer.block_manager)
