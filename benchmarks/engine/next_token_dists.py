"""Whole next-token distributions from pdserve's prompt pass, and how far one run's are from another's,
as ``llama-perplexity --kl-divergence`` measures a quantization against its base: mean KL divergence
(the base's distribution against the tested one, in nats), the share of positions with the same top-1
token, and ln(PPL tested / PPL base), each with its standard error over the scored positions.

KL divergence is the measure llama.cpp reports for "how close is this quantization to the float
model": perplexity differences move with the sign of each token's error and cancel, so two runs of
equal error can sit on either side of each other by a standard error; the divergence only adds up.

The engine's ``prompt_logprobs`` give one token's log-prob per position; the whole [positions, vocab]
rows come from the model's own logits in the same pass: ``capture`` wraps the ``compute_logits`` the
step runner hands to ``record_prompt_logprobs`` (engine/step/runner.py), which sees exactly the prompt
positions, in order, of a sequence asking for prompt logprobs. One sequence per ``generate`` call, so
every captured row is that sequence's.
"""

from __future__ import annotations

import math
from contextlib import contextmanager
from dataclasses import dataclass
from unittest.mock import patch

import torch

from engine.llm import LLM
from engine.sampling.params import SamplingParams
from engine.sampling.prompt_logprobs import record_prompt_logprobs


@contextmanager
def capture(rows: list[torch.Tensor]):
    """While active, every logits slice computed for prompt logprobs is appended to ``rows`` as
    float32 log-softmax."""

    def recording(compute_logits, hidden, batch, query_start_loc):
        def logits(h):
            out = compute_logits(h)
            rows.append(out.float().log_softmax(-1))
            return out

        return record_prompt_logprobs(logits, hidden, batch, query_start_loc)

    with patch("engine.step.runner.record_prompt_logprobs", recording):
        yield


def scored_rows(llm: LLM, tokens: list[int]) -> torch.Tensor:
    """[n - 1 - n // 2, vocab] log-probs of positions n/2 .. n-2 of ``tokens`` (each predicting the next
    token): the second half of the window, as llama-perplexity scores a chunk."""
    rows: list[torch.Tensor] = []
    with capture(rows):
        llm.generate([tokens], SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0))
    every = torch.cat(rows)  # positions 0 .. n-2
    assert every.shape[0] == len(tokens) - 1, (every.shape, len(tokens))
    return every[len(tokens) // 2 :]


def windows_rows(llm: LLM, ids: list[int], ctx: int, windows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(log-prob rows, the tokens they predict) over ``windows`` consecutive windows of ``ctx`` tokens."""
    if windows * ctx > len(ids):
        raise ValueError(f"{windows} windows of {ctx} tokens need {windows * ctx} tokens; the text has {len(ids)}")
    rows, targets = [], []
    for w in range(windows):
        window = ids[w * ctx : (w + 1) * ctx]
        rows.append(scored_rows(llm, window))
        targets.append(torch.tensor(window[ctx // 2 + 1 :]))
    return torch.cat(rows), torch.cat(targets)


def _mean_err(x: torch.Tensor) -> tuple[float, float]:
    x = x.double()
    return x.mean().item(), (x.std().item() / math.sqrt(x.numel())) if x.numel() > 1 else math.nan


@dataclass(slots=True)
class Divergence:
    """A tested run's distributions against a base run's, on the same positions."""

    positions: int
    mean_kld: float
    mean_kld_err: float
    max_kld: float
    same_top1: float  # share of positions, 0..1
    same_top1_err: float
    ln_ppl_ratio: float  # ln(PPL tested / PPL base)
    ln_ppl_ratio_err: float
    mean_abs_dlogprob: float  # of the actual next token
    max_abs_dlogprob: float

    def line(self) -> str:
        return (
            f"same_top1={self.same_top1:.4f} (+- {self.same_top1_err:.4f}) "
            f"mean_abs_dlogprob={self.mean_abs_dlogprob:.5f} max_abs_dlogprob={self.max_abs_dlogprob:.5f} "
            f"ln_ppl_ratio={self.ln_ppl_ratio:.5f} (+- {self.ln_ppl_ratio_err:.5f}) "
            f"mean_kld={self.mean_kld:.6f} (+- {self.mean_kld_err:.6f}) max_kld={self.max_kld:.5f}"
        )


def divergence(base: torch.Tensor, tested: torch.Tensor, targets: torch.Tensor) -> Divergence:
    """``base``/``tested``: [positions, vocab] log-probs; ``targets``: [positions] the actual next tokens."""
    assert base.shape == tested.shape and base.shape[0] == targets.shape[0], (base.shape, tested.shape, targets.shape)
    kld = (base.exp() * (base - tested)).sum(-1)  # KL(base || tested) per position, nats
    same = (base.argmax(-1) == tested.argmax(-1)).double()
    at = targets[:, None]
    dlogprob = tested.gather(1, at)[:, 0] - base.gather(1, at)[:, 0]  # > 0: the tested run found it likelier
    kld_mean, kld_err = _mean_err(kld)
    same_mean, same_err = _mean_err(same)
    ratio, ratio_err = _mean_err(-dlogprob)  # ln PPL = mean NLL, so the ratio is the mean NLL shift
    return Divergence(
        positions=base.shape[0],
        mean_kld=kld_mean,
        mean_kld_err=kld_err,
        max_kld=kld.max().item(),
        same_top1=same_mean,
        same_top1_err=same_err,
        ln_ppl_ratio=ratio,
        ln_ppl_ratio_err=ratio_err,
        mean_abs_dlogprob=dlogprob.abs().mean().item(),
        max_abs_dlogprob=dlogprob.abs().max().item(),
    )
