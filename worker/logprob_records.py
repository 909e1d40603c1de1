"""The engine's logprobs as wire records, for both workers (duck-typed: this package stays torch-free).

An engine ``TokenLogprobs`` has ``token_id``, ``logprob``, ``top`` [(token, logprob)] and ``rank``.
"""

from __future__ import annotations

from protocol.serving import PROMPT_LOGPROBS_PER_FRAME, PromptLogprobs, TokenLogprobRecord


def logprob_record(lp) -> TokenLogprobRecord:
    return TokenLogprobRecord(
        int(lp.token_id), float(lp.logprob), [int(t) for t, _ in lp.top], [float(v) for _, v in lp.top]
    )


def prompt_logprobs_frames(rid: str, entries: list) -> list[PromptLogprobs]:
    """A sequence's prompt logprobs (prompt tokens 1, 2, ...) cut into frames the codec's size limit takes."""
    return [
        PromptLogprobs(rid, start, [logprob_record(e) for e in part], [int(e.rank) for e in part])
        for start in range(0, len(entries), PROMPT_LOGPROBS_PER_FRAME)
        for part in [entries[start : start + PROMPT_LOGPROBS_PER_FRAME]]
    ]
