"""The front's own Prometheus metrics (prometheus-client), served on an internal port only."""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)


class FrontMetrics:
    def __init__(self, registry: CollectorRegistry | None = None):
        self.registry = registry or CollectorRegistry()
        self.requests = Counter("llm_front_requests_total", "Requests by route and HTTP status",
                                ["route", "status"], registry=self.registry)
        self.errors = Counter("llm_front_errors_total", "Error answers by route and error kind",
                              ["route", "kind"], registry=self.registry)
        self.latency = Histogram("llm_front_request_duration_seconds", "Request duration until the last byte",
                                 ["route"], buckets=LATENCY_BUCKETS, registry=self.registry)
        self.ttft = Histogram("llm_front_time_to_first_token_seconds", "Arrival to the first text sent",
                              ["route"], buckets=LATENCY_BUCKETS, registry=self.registry)
        self.inflight = Gauge("llm_front_requests_in_flight", "Requests being served", ["route"],
                              registry=self.registry)
        self.disconnects = Counter("llm_front_client_disconnects_total",
                                   "Requests whose client went away before the end", ["route"],
                                   registry=self.registry)
