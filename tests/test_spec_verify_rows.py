"""A verify step (a sequence's token and its drafts, engine/spec/) reaches attention as one decode row
per token (engine/step/runner.py), so a step of decoding and speculating sequences alone runs the
fused C decode step, as a plain decode step does; greedy output still equals plain decoding's, token
for token, and a step with a prompt chunk beside the drafts keeps the chunked path."""

from __future__ import annotations

from engine.llm import LLM
from tests.invariants import assert_no_leak
from tests.model_factory import tiny_model_dir
from tests.spec_harness import GREEDY, plain_output, spec_config


def test_verify_steps_take_the_fused_decode_step() -> None:
    family = "llama"
    prompts, expected = plain_output(family, 8)
    llm = LLM(str(tiny_model_dir(family)), block_size=8, kv_cache_memory_mb=8, speculative_config=spec_config())
    model, runner = llm.engine.runner.model, llm.engine.runner
    assert model.fused_decode is not None, "this model should take the fused decode step"
    fused_rows: list[int] = []
    run = model.fused_decode.run

    def counted(x, *args):
        fused_rows.append(x.shape[0])
        return run(x, *args)

    model.fused_decode.run = counted
    steps: list[tuple[bool, bool, int]] = []  # (has drafts, a prompt chunk in the step, fused rows)
    execute = runner.execute

    def recorded(batch):
        before = len(fused_rows)
        out = execute(batch)
        chunk = any(n > 1 and not batch.drafts_of(i) for i, n in enumerate(batch.num_new_tokens))
        steps.append((batch.has_drafts, chunk, sum(fused_rows[before:])))
        return out

    runner.execute = recorded
    # One at a time, so no prompt shares a step with another's drafts; then all at once.
    got = [llm.generate([p], GREEDY)[0].outputs[0].token_ids for p in prompts]
    assert got == expected
    verify = [s for s in steps if s[0] and not s[1]]
    assert verify, "no verify step ran"
    assert all(rows > 1 for _, _, rows in verify), "a verify step left the fused decode step"
    # A prompt admitted while another sequence speculates: their step keeps the chunked path.
    steps.clear()
    engine = llm.engine
    first = engine.add_request(prompts[0], GREEDY)
    while not steps or not steps[-1][0]:
        engine.step()
    second = engine.add_request(prompts[3], GREEDY)
    done = {}
    while engine.has_unfinished():
        done.update((out.request_id, out.outputs[0].token_ids) for out in engine.step())
    assert done == {first: expected[0], second: expected[3]}
    assert any(d and c and rows == 0 for d, c, rows in steps), "no step mixed drafts with a prompt chunk"
    assert any(d and c and rows == 0 for d, c, rows in steps), "no step mixed drafts with a prompt chunk"
    assert llm.engine.scheduler.speculator.num_accepted_tokens > 0
    assert_no_leak(llm.engine.block_manager)
