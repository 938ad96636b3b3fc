"""Reading Prometheus text exposition (Triton's `/metrics`, the front's) with prometheus-client's parser,
so label escapes, timestamps and exemplars are handled by the library the front already exports with."""
from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families


def parse_samples(text: str):
    """(name, labels, value) for every sample of the text."""
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            yield s.name, s.labels, float(s.value)


def metric_value(text: str, name: str, **labels) -> float | None:
    """Sum of the samples named `name` whose labels include `labels`; None when none matches."""
    want = {k: str(v) for k, v in labels.items()}
    values = [v for n, got, v in parse_samples(text)
              if n == name and all(got.get(k) == v for k, v in want.items())]
    return sum(values) if values else None
