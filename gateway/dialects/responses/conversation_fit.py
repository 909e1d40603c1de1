"""The Responses API's ``truncation: "auto"``: a conversation longer than the context loses its earliest
turns, whole, until its prompt fits (OpenAI: "dropping items from the beginning of the conversation").

A turn starts at a user message and runs to the next one, so a tool call is never split from its
output. The leading system message (``instructions``) stays. The number of turns to drop is found by
bisection over the rendered prompt's length (dropping more never lengthens it): a handful of renders,
however long the chain of stored responses behind it.
"""

from __future__ import annotations

from collections.abc import Callable


def fit_conversation(messages: list[dict], prompt_len: Callable[[list[dict]], int], limit: int) -> list[dict] | None:
    """``messages`` with the fewest earliest turns dropped that bring ``prompt_len`` within ``limit``;
    None where even the last turn alone does not fit."""
    if prompt_len(messages) <= limit:
        return messages
    head = 0
    while head < len(messages) and messages[head]["role"] == "system":
        head += 1
    starts = [i for i in range(head + 1, len(messages)) if messages[i]["role"] == "user"]
    kept = lambda k: messages[:head] + messages[starts[k] :]  # noqa: E731 - the conversation from turn k on
    lo, hi = 0, len(starts) - 1  # the answer, if any, is in [lo, hi]
    if not starts or prompt_len(kept(hi)) > limit:
        return None
    while lo < hi:
        mid = (lo + hi) // 2
        if prompt_len(kept(mid)) <= limit:
            hi = mid
        else:
            lo = mid + 1
    return kept(lo)
