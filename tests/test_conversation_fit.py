"""truncation "auto" (gateway/dialects/responses/conversation_fit.py): the fewest earliest whole turns dropped, found by
bisection, checked against dropping turns one at a time (the plain reading of the rule)."""

from __future__ import annotations

import pytest

from gateway.dialects.responses.conversation_fit import fit_conversation


def conversation(turns: int, system: bool = True) -> list[dict]:
    messages = [{"role": "system", "content": "rules"}] if system else []
    for t in range(turns):
        messages += [
            {"role": "user", "content": f"question {t} " + "x" * t},
            {"role": "assistant", "content": None, "tool_calls": [{"id": f"call_{t}"}]},
            {"role": "tool", "tool_call_id": f"call_{t}", "content": "out " * t},
            {"role": "assistant", "content": f"answer {t}"},
        ]
    return messages


def length(messages: list[dict]) -> int:
    return sum(len(str(m)) for m in messages)


def one_at_a_time(messages: list[dict], limit: int) -> list[dict] | None:
    """Drop the earliest turn (up to the next user message) until it fits: the rule read literally."""
    head = [m for m in messages if m["role"] == "system"][:1] if messages[0]["role"] == "system" else []
    rest = messages[len(head) :]
    while rest:
        if length(head + rest) <= limit:
            return head + rest
        nxt = next((i for i in range(1, len(rest)) if rest[i]["role"] == "user"), None)
        if nxt is None:
            return None
        rest = rest[nxt:]
    return None


@pytest.mark.parametrize("system", [True, False])
@pytest.mark.parametrize("turns", [1, 2, 7, 16])
def test_the_fewest_earliest_turns_are_dropped(turns, system):
    messages = conversation(turns, system)
    calls = []

    def counted(m):
        calls.append(len(m))
        return length(m)

    for limit in range(0, length(messages) + 50, 37):
        calls.clear()
        assert fit_conversation(messages, counted, limit) == one_at_a_time(messages, limit), limit
        assert len(calls) <= 2 + max(1, turns).bit_length() + 1  # bisection: a handful of renders


def test_a_fitting_conversation_is_kept_whole_and_a_tool_call_keeps_its_output():
    messages = conversation(5)
    assert fit_conversation(messages, length, length(messages)) is messages
    kept = fit_conversation(messages, length, length(messages) - 1)
    assert kept[0]["role"] == "system" and kept[1] == {"role": "user", "content": "question 1 x"}
    assert all(
        m["tool_call_id"] in {c["id"] for a in kept if a.get("tool_calls") for c in a["tool_calls"]}
        for m in kept
        if m["role"] == "tool"
    )
