"""The front's own Prometheus metrics (prometheus-client), served on an internal port only."""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.gc_collector import GCCollector

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)


class FrontMetrics:
    def __init__(self, registry: CollectorRegistry | None = None):
        self.registry = registry or CollectorRegistry()
        # python_gc_collections_total / _objects_collected_total by generation: a full pass of the cyclic
        # collector walks the whole heap with every stream stalled, so a request must leave no cycles
        GCCollector(registry=self.registry)
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
        # the usage ledger (ledger/writer.py) and the batch worker (front/batch/worker.py)
        self.ledger_failures = Counter("llm_ledger_write_failures_total",
                                       "Failed attempts to write spooled usage records to the ledger store",
                                       registry=self.registry)
        self.ledger_up = Gauge("llm_ledger_store_up", "1 when the last ledger write succeeded",
                               registry=self.registry)
        self.spool_segments = Gauge("llm_ledger_spool_segments", "Usage spool segments not yet in the store",
                                    registry=self.registry)
        self.spool_bytes = Gauge("llm_ledger_spool_bytes", "Bytes of usage records not yet in the store",
                                 registry=self.registry)
        self.batch_lines = Counter("llm_batch_lines_total", "Batch lines run by this front's worker, by result",
                                   ["result"], registry=self.registry)
        self.batch_retries = Counter("llm_batch_retries_total",
                                     "Batch lines the gateway asked to retry later, by error kind", ["kind"],
                                     registry=self.registry)
        self.upstream_tries = Counter("llm_front_upstream_tries_total",
                                      "Tries of an upstream provider by this front, by result (ok or why it failed)",
                                      ["upstream", "result"], registry=self.registry)
        self.connections_closed = Counter("llm_front_connections_closed_total",
                                          "Connections the front closed at its client limits (front/connections.py), "
                                          "by reason", ["reason"], registry=self.registry)
        self.sse_text_events = Counter("llm_front_sse_text_events_total",
                                       "Streamed text events after a choice's first chunk, by route and lane: direct "
                                       "(written from the engine's read, front/app.py _SseText) or send (through "
                                       "the body's generator and ASGI send)", ["route", "lane"],
                                       registry=self.registry)
        self.disconnects = Counter("llm_front_client_disconnects_total",
                                   "Requests whose client went away before the end", ["route"],
                                   registry=self.registry)
        self.engine_stops = Counter("llm_front_engine_stops_total",
                                    "Streams abandoned before their end (client gone), by how they ended: stop "
                                    "(the engine's stop, or the gateway's for a stream through it, then read to the "
                                    "end) or cancel (the gRPC call cancelled: the stop could not be sent or the "
                                    "stream outlasted DRAIN_MAX_S)", ["how"], registry=self.registry)
