"""Speculative decoding as the decode worker shows it: vLLM's ``spec_decode`` series on /metrics and
the per-request acceptance in the request's log line.

The series are read from the engine's Speculator (engine/spec/speculator.py) at scrape time: its
counters are running totals the engine keeps anyway, so the step loop does no metrics work for them.

    vllm:spec_decode_num_drafts_total                 steps that verified drafts (one per sequence)
    vllm:spec_decode_num_draft_tokens_total           draft tokens verified
    vllm:spec_decode_num_accepted_tokens_total        of those, accepted
    vllm:spec_decode_num_accepted_tokens_per_pos      accepted at draft position 0, 1, ... (label position)
"""

from __future__ import annotations

from prometheus_client.core import CounterMetricFamily

from engine.sched.sequence import Sequence
from engine.spec.speculator import Speculator


class SpecDecodeCollector:
    """A Prometheus collector over ``speculator``'s totals (registered only when the worker speculates)."""

    def __init__(self, speculator: Speculator, model_name: str):
        self.speculator = speculator
        self.model_name = model_name

    def collect(self):
        spec, labels = self.speculator, [self.model_name]
        for name, doc, value in (
            ("spec_decode_num_drafts", "Sequences' verification steps with drafts", spec.num_drafts),
            ("spec_decode_num_draft_tokens", "Draft tokens verified", spec.num_draft_tokens),
            ("spec_decode_num_accepted_tokens", "Draft tokens accepted", spec.num_accepted_tokens),
        ):
            family = CounterMetricFamily(f"vllm:{name}", doc, labels=["model_name"])
            family.add_metric(labels, value)
            yield family
        per_pos = CounterMetricFamily(
            "vllm:spec_decode_num_accepted_tokens_per_pos",
            "Draft tokens accepted, by their position among the step's drafts",
            labels=["model_name", "position"],
        )
        for pos, value in enumerate(list(spec.num_accepted_per_pos)):
            per_pos.add_metric([self.model_name, str(pos)], value)
        yield per_pos


def acceptance_note(seq: Sequence) -> str:
    """The tail of a finished request's log line: its drafts and how many were accepted ("" without)."""
    state = seq.spec
    if not state.num_draft_tokens:
        return ""
    return (
        f"; spec decode: {state.num_accepted_tokens}/{state.num_draft_tokens} draft tokens accepted "
        f"({state.acceptance_rate:.2f}) over {state.num_drafts} steps"
    )
