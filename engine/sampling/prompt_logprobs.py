"""Prompt logprobs: how likely the model found each prompt token, from the prefill's own hidden states.

The hidden state at position p predicts token p + 1, so a chunk computing positions [c, c + n) of a
prompt of P tokens gives the logprobs of prompt tokens c + 1 .. min(c + n, P - 1):

    prompt:           t0   t1   t2   t3   t4          (P = 5)
    chunk [0, 3):     h0   h1   h2                    -> logprobs of t1 t2 t3
    chunk [3, 5):                    h3   h4          -> logprob of t4 (h4 predicts the first output)

Stored in ``seq.prompt_logprobs[i]`` for prompt token i + 1; a recomputed chunk (after preemption)
overwrites its entries with the same values. Raw logits, as vLLM: no penalties, bias or temperature.
"""

from __future__ import annotations

import torch

from engine.sampling.sampler import token_logprobs
from engine.sched.batch import ScheduledBatch

# Logits rows computed at once: bounds the [rows, vocab] float32 block (256 x 152k vocab = 156 MB).
ROWS_PER_SLICE = 256


def record_prompt_logprobs(
    compute_logits, hidden: torch.Tensor, batch: ScheduledBatch, query_start_loc: torch.Tensor
) -> None:
    """For every sequence of ``batch`` that needs them, the logprobs of the prompt tokens its chunk
    predicts. ``hidden``: [tokens, hidden] of the step (before the final norm); ``compute_logits``:
    the model's norm + LM head."""
    starts = None
    for i, (seq, n) in enumerate(zip(batch.seqs, batch.num_new_tokens)):
        if not seq.needs_prompt_logprobs:
            continue
        first = seq.num_computed_tokens  # before postprocess advances it
        last = min(first + n, seq.num_prompt_tokens - 1)  # positions [first, last) predict prompt tokens
        if last <= first:
            continue
        if starts is None:
            starts = query_start_loc.tolist()
        rows = hidden[starts[i] : starts[i] + last - first]
        targets = torch.tensor(seq.token_ids[first + 1 : last + 1], device=hidden.device)
        entries = []
        for s in range(0, rows.shape[0], ROWS_PER_SLICE):
            entries += token_logprobs(
                compute_logits(rows[s : s + ROWS_PER_SLICE]),
                targets[s : s + ROWS_PER_SLICE],
                seq.params.prompt_logprobs,
            )
        del seq.prompt_logprobs[first:]
        seq.prompt_logprobs.extend(entries)
