"""The front's own Prometheus metrics (prometheus-client), served on an internal port only."""
from __future__ import annotations

import gc
import time
from bisect import bisect_left

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.gc_collector import GCCollector
from prometheus_client.metrics_core import HistogramMetricFamily

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
LEASE_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)


class GcPauses:
    """The cyclic collector's passes timed, by generation (`llm_front_gc_pause_seconds`): each pass stops the
    event loop and every stream on it. One per process (gc.callbacks), shared by every registry."""

    BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25)
    _instance: "GcPauses | None" = None

    def __init__(self):
        self.counts = [[0] * (len(self.BUCKETS) + 1) for _ in range(3)]
        self.sums = [0.0, 0.0, 0.0]
        self._began = 0.0
        gc.callbacks.append(self._on_pass)

    @classmethod
    def of_process(cls) -> "GcPauses":
        if cls._instance is None:
            cls._instance = cls()
        return cls._instance

    def _on_pass(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._began = time.perf_counter()
            return
        took, g = time.perf_counter() - self._began, info["generation"]
        self.sums[g] += took
        self.counts[g][bisect_left(self.BUCKETS, took)] += 1

    def collect(self):
        family = HistogramMetricFamily("llm_front_gc_pause_seconds", "Passes of the cyclic collector, each a stall "
                                       "of the event loop, by generation (2: the whole heap not frozen)",
                                       labels=["generation"])
        for g in range(3):
            total, buckets = 0, []
            for bound, n in zip((*map(str, self.BUCKETS), "+Inf"), self.counts[g]):
                total += n
                buckets.append((bound, total))
            family.add_metric([str(g)], buckets, self.sums[g])
        yield family


class FrontMetrics:
    def __init__(self, registry: CollectorRegistry | None = None):
        self.registry = registry or CollectorRegistry()
        # python_gc_collections_total / _objects_collected_total by generation: a full pass of the cyclic
        # collector walks the whole heap with every stream stalled, so a request must leave no cycles
        GCCollector(registry=self.registry)
        self.registry.register(GcPauses.of_process())
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
        self.token_lane = Gauge("llm_front_token_lane", "1 for the per-token path this process runs (front/token_lane.py): "
                                "compiled (front/token_lane.c) or python", ["lane"], registry=self.registry)
        self.disconnects = Counter("llm_front_client_disconnects_total",
                                   "Requests whose client went away before the end", ["route"],
                                   registry=self.registry)
        self.admits = Counter("llm_front_admits_total",
                              "Admits sent to the gateway, alone or in a group of several (front/grouped_admits.py)",
                              ["sent"], registry=self.registry)
        self.admit_groups = Counter("llm_front_admit_groups_total",
                                    "Requests to the gateway that carried a group of several admits",
                                    registry=self.registry)
        self.lease_operations = Histogram(
            "llm_front_lease_operation_seconds",
            "The gateway's answer to a lease operation as this front waited for it: admit (authentication, limits, "
            "routing and an engine slot, its admission-queue wait included), settle (awaited before [DONE])",
            ["operation"], buckets=LEASE_BUCKETS, registry=self.registry)
        self.lease_requests = Counter("llm_front_lease_requests_total",
                                      "Requests of lease operations sent to the gateway (an admit or a group of them, "
                                      "a group of settles, a renew, an engine_check, a stop), by channel: socket (the "
                                      "gateway's lease socket) or triton (through Triton, while the socket is not open "
                                      "or where there is none)", ["channel"], registry=self.registry)
        self.hand_backs = Counter("llm_front_lease_hand_backs_total",
                                  "Leases handed back to stream through the gateway: a LoRA adapter whose weights the "
                                  "engine does not hold (its first use, or evicted from TensorRT-LLM's LoRA cache)",
                                  registry=self.registry)
        self.engine_stops = Counter("llm_front_engine_stops_total",
                                    "Streams abandoned before their end (client gone), by how they ended: stop "
                                    "(the engine's stop, or the gateway's for a stream through it, then read to the "
                                    "end) or cancel (the gRPC call cancelled: the stop could not be sent or the "
                                    "stream outlasted DRAIN_MAX_S)", ["how"], registry=self.registry)
