"""Engine sequences -> TokenEvents: what each completion has generated since its last event.

seq.output_token_ids: [ streamed (num_sent) ........ | new this step ]
                      0 (offset 0 may be the prefill worker's first token)  -> TokenEvent(offset=num_sent)
"""

from __future__ import annotations

from engine.sched.sequence import Sequence, SequenceStatus
from protocol.serving import TOKEN_EVENTS_PER_FRAME, TokenEvent, TokenEvents
from worker.logprob_records import logprob_record

FINISH_REASONS = {SequenceStatus.FINISHED_STOPPED: "stop", SequenceStatus.FINISHED_LENGTH: "length"}


def new_tokens_event(
    rid: str, index: int, seq: Sequence, num_sent: int, wants_logprobs: bool, num_cached_tokens: int = -1
) -> TokenEvent | None:
    """The event carrying ``seq``'s outputs from ``num_sent`` on (and its finish reason when it just
    finished); None when there is nothing new to say."""
    tokens = seq.output_token_ids[num_sent:]
    finish_reason = FINISH_REASONS.get(seq.status, "")
    if not tokens and not finish_reason:
        return None
    logprobs = None
    if wants_logprobs:
        logprobs = [logprob_record(lp) for lp in seq.output_logprobs[num_sent : num_sent + len(tokens)]]
    return TokenEvent(rid, index, num_sent, tokens, logprobs, finish_reason, num_cached_tokens)


def error_event(
    rid: str, index: int, offset: int, error: str, refused: bool = False, culprit: str = "decode"
) -> TokenEvent:
    """``culprit``: whose fault (protocol/serving.py CULPRITS); a refusal is the client's, nobody's here."""
    return TokenEvent(
        rid, index, offset, [], error=error[:1000], refused=refused, culprit="none" if refused else culprit
    )


def event_frames(events: list[TokenEvent]):
    """A step's events for one gateway as frames of at most TOKEN_EVENTS_PER_FRAME (a lone one as itself)."""
    for start in range(0, len(events), TOKEN_EVENTS_PER_FRAME):
        chunk = events[start : start + TOKEN_EVENTS_PER_FRAME]
        yield chunk[0] if len(chunk) == 1 else TokenEvents(chunk)
