"""Where a speculating step's time goes, in process, on the real SmolLM2-135M (float32):

    python -m benchmarks.engine.spec_profile [--spec JSON] [--workload spec_copy] [--max-tokens 128]
        [--verify-rows 1,2,3,5,9,17] [--rounds 3] [--threads 2]

Two parts, each measured side by side in one process:

1. ``verify``: the model step (``ModelRunner.execute``) of one sequence computing ``r`` rows (its token
   and ``r - 1`` drafts, made up so that all are rejected), against the 1-row decode step; rounds
   alternate the row counts. Printed as ms and as a ratio to 1 row: what a verify pass costs.
2. ``steps``: one greedy request of the workload with ``--spec`` speculation, every step split into
   the proposal (the proposer's ``propose_batch``), the rest of ``schedule``, the model step, and
   ``postprocess``; with the mean drafts and accepted drafts per verify step and the tokens per step.

Medians over steps, so a loaded machine's stray slow steps move the figures little; compare ratios.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import replace

from benchmarks.engine.spec_decode import SPEC, chat_ids
from benchmarks.engine.spec_workloads import chat_prompts, smollm2_checkpoint
from engine.llm import LLM
from engine.sampling.params import SamplingParams


class FixedDrafts:
    """A proposer whose drafts are ``r - 1`` copies of a token that is never the greedy choice here
    (token 0), so every step verifies exactly ``r`` rows and keeps one token."""

    def __init__(self, rows: int):
        self.rows = rows

    def propose_batch(self, seqs, limits):
        for seq in seqs:
            seq.spec.draft_probs = None
        return [[0] * min(self.rows - 1, limit) for limit in limits]

    def release(self, seq) -> None:
        pass


def verify_costs(llm: LLM, prompt: list[int], rows: list[int], rounds: int, steps: int) -> dict[int, float]:
    """Median ms of the model step at each row count (1 = a plain decode step), rounds alternated."""
    engine = llm.engine
    speculator = engine.scheduler.speculator
    speculator.config = _no_backoff(speculator.config, max(rows) - 1)
    times: dict[int, list[float]] = {r: [] for r in rows}
    execute = engine.runner.execute
    for _ in range(rounds):
        for r in rows:
            speculator.proposer = FixedDrafts(r)
            engine.add_request(prompt, SamplingParams(temperature=0.0, max_tokens=steps + r, ignore_eos=True))
            engine.step()  # the prompt
            while engine.has_unfinished():
                batch = engine.scheduler.schedule()
                start = time.perf_counter()
                sampled = execute(batch)
                elapsed = time.perf_counter() - start
                engine.scheduler.postprocess(batch, sampled.token_ids, sampled.logprobs, sampled.accepted)
                if batch.num_batched_tokens == r:
                    times[r].append(elapsed)
    return {r: statistics.median(t) * 1e3 for r, t in times.items()}


def _no_backoff(config, k: int):
    # The made-up drafts are all rejected: without this the back-off would stop them after a step.
    return replace(
        config, num_speculative_tokens=max(k, 1), min_acceptance=0.0, verify_row_cost=0.0, max_num_seqs=1 << 20
    )


def step_profile(llm: LLM, prompt: list[int], max_tokens: int) -> dict[str, float]:
    engine = llm.engine
    scheduler, runner = engine.scheduler, engine.runner
    proposer = scheduler.speculator.proposer
    propose = proposer.propose_batch
    spent = [0.0]

    def timed_propose(seqs, limits):
        start = time.perf_counter()
        out = propose(seqs, limits)
        spent[0] += time.perf_counter() - start
        return out

    proposer.propose_batch = timed_propose
    try:
        engine.add_request(prompt, SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True))
        engine.step()  # the prompt
        rows = {k: [] for k in ("propose", "schedule", "model", "postprocess", "drafts", "accepted", "tokens")}
        while engine.has_unfinished():
            spent[0] = 0.0
            t0 = time.perf_counter()
            batch = scheduler.schedule()
            t1 = time.perf_counter()
            sampled = runner.execute(batch)
            t2 = time.perf_counter()
            seq = batch.seqs[0]
            before = seq.num_tokens
            scheduler.postprocess(batch, sampled.token_ids, sampled.logprobs, sampled.accepted)
            t3 = time.perf_counter()
            drafts = len(batch.drafts_of(0))
            rows["propose"].append(spent[0])
            rows["schedule"].append(t1 - t0 - spent[0])
            rows["model"].append(t2 - t1)
            rows["postprocess"].append(t3 - t2)
            rows["drafts"].append(drafts)
            rows["accepted"].append(len(sampled.accepted[0]) if drafts else 0)
            rows["tokens"].append(seq.num_tokens - before)
    finally:
        del proposer.propose_batch
    verify = [i for i, d in enumerate(rows["drafts"]) if d]
    return {
        "steps": len(rows["model"]),
        "verify_steps": len(verify),
        "drafts_per_verify": statistics.mean(rows["drafts"][i] for i in verify) if verify else 0.0,
        "accepted_per_verify": statistics.mean(rows["accepted"][i] for i in verify) if verify else 0.0,
        "tokens_per_step": statistics.mean(rows["tokens"]),
        **{f"{k}_ms": statistics.median(rows[k]) * 1e3 for k in ("propose", "schedule", "model", "postprocess")},
        "total_s": sum(sum(rows[k]) for k in ("schedule", "propose", "model", "postprocess")),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--spec", default=json.dumps(SPEC))
    ap.add_argument("--workload", default="spec_copy")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--verify-rows", default="1,2,3,5,9,17")
    ap.add_argument("--verify-steps", type=int, default=24)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    path = str(smollm2_checkpoint())
    common = dict(num_threads=args.threads, kv_cache_memory_mb=256, max_num_seqs=32)
    llm = LLM(path, speculative_config=args.spec, **common)
    prompt = chat_ids(llm.tokenizer, chat_prompts(args.workload, 1)[0])
    rows = [int(r) for r in args.verify_rows.split(",")]
    step_profile(llm, prompt, 8)  # warm-up
    profile = step_profile(llm, prompt, args.max_tokens)
    print("steps " + " ".join(f"{k}={v:.3g}" for k, v in profile.items()), flush=True)
    costs = verify_costs(llm, prompt, rows, args.rounds, args.verify_steps)
    print("verify " + " ".join(f"rows={r}: {ms:.2f}ms ({ms / costs[rows[0]]:.2f}x)" for r, ms in costs.items()))


if __name__ == "__main__":
    main()
