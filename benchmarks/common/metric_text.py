"""Reading named samples from a Prometheus text exposition, strictly.

A benchmark that reads a series the server no longer exports (renamed, say, from ``pdserve:`` to
``vllm:``) must fail with the name, not report 0: a silent 0 once hid that the TTFT of every P/D run
went uncaptured (issue #48).
"""

from __future__ import annotations

import re

from prometheus_client.parser import text_string_to_metric_families


class MissingMetric(LookupError):
    def __init__(self, names: list[str], where: str = ""):
        self.names = names
        super().__init__(f"metric(s) not exported{f' by {where}' if where else ''}: {', '.join(names)}")


def metric_sums(text: str, names: set[str] | list[str], where: str = "") -> dict[str, float]:
    """Each named sample (e.g. ``pdserve:kv_transfer_bytes_sum``) summed over its labels; raises
    MissingMetric naming every one with no sample at all."""
    wanted = set(names)
    sums: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in wanted:
                sums[sample.name] = sums.get(sample.name, 0.0) + sample.value
    if missing := sorted(wanted - sums.keys()):
        raise MissingMetric(missing, where)
    return sums


def selected_sum(text: str, selector: str, where: str = "") -> float:
    """``name`` or ``name{label="value",...}``: the sum of the samples of ``name`` whose labels include
    the given ones. A label set is exported from its first count on, so a selected set not seen yet is
    0 where ``name`` has samples; MissingMetric only when ``name`` has none at all."""
    name, _, rest = selector.partition("{")
    wanted = dict(re.findall(r'(\w+)="([^"]*)"', rest))
    total, seen = 0.0, False
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name:
                seen = True
                if all(sample.labels.get(k) == v for k, v in wanted.items()):
                    total += sample.value
    if not seen:
        raise MissingMetric([name], where)
    return total
