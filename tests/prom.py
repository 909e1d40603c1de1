"""Reading Prometheus text as a scraper does (prometheus_client's parser), so a test names a series by
its labels, not by how one exporter happens to order them."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families


def samples(text: str, name: str, **labels: str) -> list[float]:
    """The values of every sample ``name`` whose labels include ``labels``."""
    return [
        s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())
    ]


def total(text: str, name: str, **labels: str) -> float:
    return sum(samples(text, name, **labels))


def series(text: str, name: str) -> list[tuple[dict[str, str], float]]:
    """(labels, value) of every sample ``name``."""
    return [
        (s.labels, s.value) for family in text_string_to_metric_families(text) for s in family.samples if s.name == name
    ]
