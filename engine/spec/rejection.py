"""Verification of draft tokens against the target model (speculative sampling, Leviathan et al. 2023;
Chen et al. 2023).

For one sequence with drafts d_1..d_k the target gives k + 1 distributions p_0..p_k (p_i: the next token
after the sequence and d_1..d_i). Draft d_{i+1} was proposed from q_i.

    greedy:  accept d_{i+1} while it is the argmax of p_i; the first mismatch position i emits argmax p_i
             (so the output is the target's greedy output, token for token).
    sampled: accept d_{i+1} with probability min(1, p_i(d) / q_i(d)); on rejection emit a token drawn from
             the residual norm(max(p_i - q_i, 0)); after k acceptances draw a bonus token from p_k.
             Every emitted token is then distributed as p (the theorem of both papers).

A point-mass draft (n-gram proposals) has q_i = onehot(d_{i+1}): accept with probability p_i(d), and the
residual is p_i with d's entry zeroed.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(slots=True)
class Verdict:
    accepted: list[int]  # the leading drafts the target accepted
    token: int  # the token emitted after them: the correction at the first rejection, or the bonus

    @property
    def num_accepted(self) -> int:
        return len(self.accepted)


def verify_greedy(target_tokens: list[int], drafts: list[int]) -> Verdict:
    """``target_tokens``: argmax of p_0..p_k (k + 1 ids)."""
    assert len(target_tokens) == len(drafts) + 1, (len(target_tokens), len(drafts))
    accepted = 0
    while accepted < len(drafts) and drafts[accepted] == target_tokens[accepted]:
        accepted += 1
    return Verdict(drafts[:accepted], target_tokens[accepted])


def verify_sampled(
    target_probs: torch.Tensor,
    drafts: list[int],
    generator: torch.Generator | None,
    draft_probs: torch.Tensor | None = None,
) -> Verdict:
    """``target_probs`` [k + 1, V]: p_0..p_k after the request's sampling filters; ``draft_probs`` [k, V]:
    q_0..q_{k-1}, None for a point-mass (n-gram) draft."""
    k = len(drafts)
    assert target_probs.shape[0] == k + 1, (target_probs.shape, k)
    assert draft_probs is None or draft_probs.shape == (k, target_probs.shape[1])
    uniforms = torch.rand(k + 1, generator=generator, device=target_probs.device).tolist()
    for i, d in enumerate(drafts):
        p = target_probs[i]
        q_d = 1.0 if draft_probs is None else float(draft_probs[i, d])
        if uniforms[i] * q_d < float(p[d]):  # u < p(d) / q(d) without dividing by a zero q(d)
            continue
        if draft_probs is None:
            residual = p.clone()
            residual[d] = 0.0
        else:
            residual = (p - draft_probs[i]).clamp_(min=0.0)
        return Verdict(drafts[:i], _draw(residual, uniforms[k]))
    return Verdict(list(drafts), _draw(target_probs[k], uniforms[k]))


def _draw(weights: torch.Tensor, u: float) -> int:
    """Inverse-CDF draw from unnormalised ``weights`` [V] with uniform ``u``; the last token with weight
    > 0 when rounding pushes ``u * total`` past the cumulative sum."""
    cdf = weights.double().cumsum(0)
    total = float(cdf[-1])
    if total <= 0.0:  # p == q exactly, so rejection had probability 0: the caller's p is degenerate
        return int(weights.argmax())
    index = int(torch.searchsorted(cdf, torch.tensor([u * total], dtype=cdf.dtype)).item())
    nonzero = (weights > 0).nonzero()
    return min(index, int(nonzero[-1])) if index >= weights.shape[0] else _skip_zero(weights, index, nonzero)


def _skip_zero(weights: torch.Tensor, index: int, nonzero: torch.Tensor) -> int:
    # searchsorted lands on the first cdf >= u * total: never a zero-weight token unless u * total sits
    # exactly on a plateau's left edge; then the next token with weight takes it.
    if float(weights[index]) > 0.0:
        return index
    later = nonzero[nonzero[:, 0] > index]
    return int(later[0]) if later.numel() else int(nonzero[-1])
