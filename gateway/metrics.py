"""The gateway's per-tenant metrics, defined once; bound to `pb_utils.MetricFamily` inside Triton
(through `AppliedInBackground`) and to an in-memory registry in tests."""
from __future__ import annotations

import asyncio
import bisect
import gc
import logging
import math
import threading
import time

LATENCY_BUCKETS = [0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0]
ITL_BUCKETS = [0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0]

# name -> (kind, description, buckets, label names in the order GatewayMetrics gives their values)
FAMILIES = {
    "gateway_requests_total": ("counter", "Gateway requests by tenant, model and outcome", None,
                               ("tenant", "model", "outcome")),
    "gateway_rejections_total": ("counter", "Requests rejected before the engine, by reason", None, ("tenant", "reason")),
    "gateway_input_tokens_total": ("counter", "Prompt tokens of admitted requests", None, ("tenant", "model")),
    "gateway_output_tokens_total": ("counter", "Tokens generated for the tenant", None, ("tenant", "model")),
    "gateway_cost_total": ("counter", "Cost of the tenant's tokens at its configured prices", None, ("tenant", "model")),
    "gateway_adapter_requests_total": ("counter", "Gateway requests with a LoRA adapter, by adapter", None,
                                       ("tenant", "model", "adapter", "outcome")),
    "gateway_adapter_output_tokens_total": ("counter", "Tokens generated with a LoRA adapter, by adapter", None,
                                            ("tenant", "model", "adapter")),
    "gateway_lora_weights_sent_total": ("counter", "Requests that carried a LoRA adapter's converted weights to the "
                                                   "engine, by why: first_use (not sent from here before, or sent "
                                                   "again before the engine's first answer) or evicted (the engine "
                                                   "said it no longer held them)", None,
                                        ("model", "adapter", "reason")),
    "gateway_time_to_first_token_seconds": ("histogram", "Time from arrival to the first text", LATENCY_BUCKETS,
                                            ("tenant", "model")),
    "gateway_inter_token_latency_seconds": ("histogram", "Mean time between output tokens per request", ITL_BUCKETS,
                                            ("tenant", "model")),
    "gateway_queue_wait_seconds": ("histogram", "Time spent waiting for an engine slot", LATENCY_BUCKETS, ("tenant",)),
    "gateway_admission_queue_depth": ("gauge", "Requests waiting for an engine slot", None, ("model",)),
    "gateway_inflight_requests": ("gauge", "Engine slots held by the gateway's requests", None, ("model",)),
    "gateway_kv_held_tokens": ("gauge", "Engine KV tokens held by the gateway's requests in flight (prompt + "
                               "max_tokens, whole blocks)", None, ("model",)),
    "gateway_reserved_tokens": ("gauge", "Tokens reserved by requests in flight", None, ("tenant",)),
    "gateway_ratelimit_backend_up": ("gauge", "1 when the shared rate-limit store answers, 0 when not", None,
                                     ("backend",)),
    "gateway_response_cache_requests_total": ("counter", "Response-cache lookups (hit, miss, error) and answers "
                                                         "stored (stored), by tenant", None, ("tenant", "result")),
    "gateway_session_turns_total": ("counter", "Session turns served, by tenant and whether the sliding window "
                                               "dropped old turns (window: fit | slid)", None, ("tenant", "window")),
    "gateway_truncations_total": ("counter", "Requests whose conversation may slide (the Responses API's truncation "
                                             "auto), by tenant and whether it dropped old turns (window: fit | slid)",
                                  None, ("tenant", "window")),
    "gateway_upstream_circuit_state": ("gauge", "An upstream provider's circuit: 0 closed, 1 half-open, 2 open", None,
                                       ("upstream",)),
    "gateway_upstream_circuit_transitions_total": ("counter", "Circuit state changes of an upstream, by new state",
                                                   None, ("upstream", "to")),
    "gateway_upstream_errors_total": ("counter", "Failed tries of an upstream reported by the front, by kind", None,
                                      ("upstream", "kind")),
    "gateway_fallbacks_total": ("counter", "Requests answered by another model than asked, past a failed or open "
                                           "upstream", None, ("requested", "used")),
    "gateway_ratelimit_fail_open_active": ("gauge", "1 while the store is unreachable and fail_open admits without "
                                                    "limits, else 0", None, ("backend",)),
    "gateway_gc_pause_seconds_total": ("counter", "Seconds the gateway's process stood still in Python's cyclic "
                                                  "garbage collector, by generation (2: a full pass), its event "
                                                  "loop and every admit and settle with it", None, ("generation",)),
    "gateway_event_loop_cpu_seconds_total": ("counter", "CPU seconds of the thread running the gateway's event loop, "
                                                        "which admits and settles every request of its server: a "
                                                        "rate near 1 means requests queue behind it", None, ()),
}



class MemoryRegistry:
    """A test double with the same interface as the Triton binding: family(name).labels(**l)."""

    def __init__(self):
        self.values: dict[tuple, float] = {}
        self.observations: dict[tuple, list[float]] = {}

    def metric(self, name: str, labels: dict):
        registry, key = self, (name, tuple(sorted(labels.items())))

        class _M:
            def increment(self, v=1.0):
                registry.values[key] = registry.values.get(key, 0.0) + v

            def set(self, v):
                registry.values[key] = float(v)

            def observe(self, v):
                registry.observations.setdefault(key, []).append(v)

            def observe_many(self, values):
                registry.observations.setdefault(key, []).extend(values)

        return _M()

    def value(self, name: str, **labels) -> float:
        return self.values.get((name, tuple(sorted(labels.items()))), 0.0)


def bucket_label(bound: float) -> str:
    """A bucket's `le` as Prometheus 3 stores a histogram's (0.025, 5.0, +Inf), whichever version scrapes it."""
    return "+Inf" if bound == math.inf else repr(float(bound))


class CountedHistogram:
    """One histogram series as the series Prometheus reads a histogram as: `<name>_bucket{le}` (cumulative),
    `<name>_sum` and `<name>_count`, so `histogram_quantile` and the SLO rules read it unchanged.

    Why not Triton's own histogram: the python backend observes one value per call, and each call is an IPC
    round trip to tritonserver during which the stub holds the GIL (its binding does not release it), so the
    gateway's event loop stood still for every observation, about three per request (queue wait, TTFT, ITL).
    Here the values that accumulated between two ticks cost one call per bucket they reach, plus two.

    The totals are kept here and exported as gauges set to them: a Triton counter named `..._count` is read by
    prometheus-client's parser as `..._count_total` (OpenMetrics' counter suffix), a gauge keeps its name.
    Prometheus itself reads either the same way (a stub's restart is a reset, as a counter's). Setting them is
    right for one process only: the gateway is one stub (its config's count 1: admission is one process's)."""

    __slots__ = ("bounds", "buckets", "sum", "count", "totals", "total_sum")

    def __init__(self, families: tuple, labels: dict, bounds: list[float]):
        bucket, total, count = families
        self.bounds = bounds
        self.buckets = [bucket.Metric(labels={**labels, "le": bucket_label(b)}) for b in (*bounds, math.inf)]
        self.sum, self.count = total.Metric(labels=labels), count.Metric(labels=labels)
        self.totals, self.total_sum = [0] * len(self.buckets), 0.0

    def observe_many(self, values: list[float]) -> None:
        landed = [0] * len(self.buckets)
        for v in values:
            landed[bisect.bisect_left(self.bounds, v)] += 1  # the first bucket whose bound is >= v
        below = 0
        for i, n in enumerate(landed):
            below += n
            if below:
                self.totals[i] += below
                self.buckets[i].set(self.totals[i])
        self.total_sum += math.fsum(values)
        self.sum.set(self.total_sum)
        self.count.set(self.totals[-1])


HISTOGRAM_SERIES = ("_bucket", "_sum", "_count")


class TritonRegistry:
    """Binds the families to `pb_utils.MetricFamily` (only usable after the stub started); a histogram to
    three gauge families (`CountedHistogram`)."""

    def __init__(self, pb_utils):
        kinds = {"counter": pb_utils.MetricFamily.COUNTER, "gauge": pb_utils.MetricFamily.GAUGE}
        self.families = {}
        for name, (kind, description, *_) in FAMILIES.items():
            if kind == "histogram":
                self.families[name] = tuple(pb_utils.MetricFamily(name=name + suffix, description=description,
                                                                  kind=kinds["gauge"])
                                            for suffix in HISTOGRAM_SERIES)
            else:
                self.families[name] = pb_utils.MetricFamily(name=name, description=description, kind=kinds[kind])
        self.cache = {}

    def metric(self, name: str, labels: dict):
        key = (name, tuple(sorted(labels.items())))
        if key not in self.cache:
            kind, _, buckets, _ = FAMILIES[name]
            self.cache[key] = (CountedHistogram(self.families[name], labels, buckets) if kind == "histogram"
                               else self.families[name].Metric(labels=labels))
        return self.cache[key]


class AppliedInBackground:
    """Records metric updates and applies them to `inner` from a thread of its own, every `interval_s`.

    Each update of a Triton custom metric is an IPC round trip from the stub to tritonserver that blocks
    its caller: 150-250 µs each and about 15 per request (admit and settle), measured in the gateway stub
    (docs/benchmarks.md), which on the event loop that admits every request of the server was most of
    its time per request. Here an update is a dict write under a lock; each tick applies what
    accumulated: a counter's increments and a gauge's settings as one call per series, a histogram's
    observations as one `observe_many` (`CountedHistogram`: a call per bucket reached). Prometheus scrapes
    every few seconds, so `interval_s` is invisible there."""

    def __init__(self, inner, interval_s: float = 0.05):
        self.inner, self.interval_s = inner, interval_s
        self._lock = threading.Lock()
        self._applying = threading.Lock()
        self._pending: dict[tuple, list] = {}  # (name, labels) -> [op, value]; observe_many: [op, [values]]
        threading.Thread(target=self._run, name="gateway-metrics", daemon=True).start()

    def metric(self, name: str, labels: dict):
        return _Recorded(self, (name, tuple(sorted(labels.items()))))

    def record(self, key: tuple, op: str, value: float) -> None:
        with self._lock:
            entry = self._pending.get(key)
            if op == "observe_many":
                if entry is None:
                    self._pending[key] = [op, [value]]
                else:
                    entry[1].append(value)
            elif op == "increment" and entry is not None:
                entry[1] += value
            else:
                self._pending[key] = [op, value]

    def flush(self) -> None:
        """Apply every update recorded so far (each tick, and at unload)."""
        with self._applying:
            with self._lock:
                batch, self._pending = self._pending, {}
            for (name, labels), (op, value) in batch.items():
                try:
                    getattr(self.inner.metric(name, dict(labels)), op)(value)
                except Exception:  # a metric must never take the gateway down
                    logging.getLogger("gateway").exception("gateway metric %s not updated", name)

    def _run(self) -> None:
        while True:
            time.sleep(self.interval_s)
            self.flush()


class LoopCpu:
    """Counts the CPU time of the thread that runs the gateway's event loop (`time.thread_time`, read on the
    loop every `interval_s`) into `gateway_event_loop_cpu_seconds_total`.

    That loop admits and settles every request of its server in one process (docs/benchmarks.md: at short
    requests it, not the engine, bounds a server's requests a second), and once it is busy all the time
    admits wait behind each other and the time to first token grows. Its rate is the share of one core it
    uses, so operations see the gateway saturate (the LLMGatewayLoopSaturated alert) before clients do."""

    def __init__(self, metrics: "GatewayMetrics", interval_s: float = 1.0, cpu_clock=time.thread_time):
        self.metrics, self.interval_s, self.cpu_clock = metrics, interval_s, cpu_clock

    async def run(self) -> None:
        last = self.cpu_clock()
        while True:
            await asyncio.sleep(self.interval_s)
            now = self.cpu_clock()
            self.metrics.loop_cpu(now - last)
            last = now


class GcPauses:
    """Times each pass of the cyclic collector in this process (`gc.callbacks`) and adds them to
    `gateway_gc_pause_seconds_total` from the event loop every `interval_s`.

    A pass stops every thread, the loop that admits and settles every request included: full passes over the
    whole heap cost it 22-58 ms of each 20 s under load before the gateway froze what it built to serve
    (model.py; docs/benchmarks.md).
    The callback only adds to a float (a pass holds the GIL, so two never overlap): it may run inside any
    allocation, even in the metric thread holding its own lock, so it takes none."""

    def __init__(self, metrics: "GatewayMetrics", interval_s: float = 1.0, clock=time.perf_counter):
        self.metrics, self.interval_s, self.clock = metrics, interval_s, clock
        self.seconds = [0.0, 0.0, 0.0]  # by generation, since the start
        self._started = None
        gc.callbacks.append(self.timed)

    def timed(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._started = self.clock()
        elif self._started is not None:
            self.seconds[info["generation"]] += self.clock() - self._started
            self._started = None

    async def run(self) -> None:
        published = [0.0, 0.0, 0.0]
        while True:
            await asyncio.sleep(self.interval_s)
            for generation, total in enumerate(list(self.seconds)):
                if total > published[generation]:
                    self.metrics.gc_pause(str(generation), total - published[generation])
                    published[generation] = total


class _Recorded:
    __slots__ = ("registry", "key")

    def __init__(self, registry: AppliedInBackground, key: tuple):
        self.registry, self.key = registry, key

    def increment(self, v=1.0):
        self.registry.record(self.key, "increment", v)

    def set(self, v):
        self.registry.record(self.key, "set", v)

    def observe(self, v):
        self.registry.record(self.key, "observe_many", v)


class GatewayMetrics:
    """The gateway's metric updates by what happened. A series' handle is made once per label values and
    kept (`_series`): building and sorting its labels on every update cost the event loop more than the
    update itself, about 15 of them per admitted and settled request."""

    def __init__(self, registry):
        self.r = registry
        self._handles: dict[tuple, object] = {}

    def _series(self, name: str, *values):
        handle = self._handles.get((name, values))
        if handle is None:
            handle = self._handles[(name, values)] = self.r.metric(name, dict(zip(FAMILIES[name][3], values)))
        return handle

    def rejected(self, tenant: str, reason: str):
        self._series("gateway_rejections_total", tenant, reason).increment(1)

    def finished(self, tenant: str, model: str, outcome: str, n_in: int, n_out: int, cost: float):
        self._series("gateway_requests_total", tenant, model, outcome).increment(1)
        self._series("gateway_input_tokens_total", tenant, model).increment(n_in)
        self._series("gateway_output_tokens_total", tenant, model).increment(n_out)
        self._series("gateway_cost_total", tenant, model).increment(cost)

    def adapter_finished(self, tenant: str, model: str, adapter: str, outcome: str, n_out: int):
        self._series("gateway_adapter_requests_total", tenant, model, adapter, outcome).increment(1)
        self._series("gateway_adapter_output_tokens_total", tenant, model, adapter).increment(n_out)

    def lora_weights_sent(self, model: str, adapter: str, reason: str):
        self._series("gateway_lora_weights_sent_total", model, adapter, reason).increment(1)

    def ttft(self, tenant: str, model: str, seconds: float):
        self._series("gateway_time_to_first_token_seconds", tenant, model).observe(seconds)

    def itl(self, tenant: str, model: str, seconds: float):
        self._series("gateway_inter_token_latency_seconds", tenant, model).observe(seconds)

    def queue_wait(self, tenant: str, seconds: float):
        self._series("gateway_queue_wait_seconds", tenant).observe(seconds)

    def queue_depth(self, model: str, depth: int):
        self._series("gateway_admission_queue_depth", model).set(depth)

    def inflight(self, model: str, n: int, kv_tokens: int = 0):
        self._series("gateway_inflight_requests", model).set(n)
        self._series("gateway_kv_held_tokens", model).set(kv_tokens)

    def reserved(self, tenant: str, tokens: int):
        self._series("gateway_reserved_tokens", tenant).set(tokens)

    def backend_up(self, up: bool, fail_policy: str = "fail_open"):
        """The shared store answered (or not); with fail_open an unreachable store means no limits at all,
        which operations must see (the LLMGatewayFailOpen alert, deploy/prometheus/rules.yml)."""
        self._series("gateway_ratelimit_backend_up", "redis").set(1 if up else 0)
        self._series("gateway_ratelimit_fail_open_active", "redis").set(1 if not up and fail_policy == "fail_open" else 0)

    def response_cache(self, tenant: str, result: str):
        """result: hit | miss | error (lookups), stored (answers kept); hit rate = hit / (hit + miss + error)."""
        self._series("gateway_response_cache_requests_total", tenant, result).increment(1)

    def session_turn(self, tenant: str, slid: bool):
        self._series("gateway_session_turns_total", tenant, "slid" if slid else "fit").increment(1)

    def truncation(self, tenant: str, slid: bool):
        self._series("gateway_truncations_total", tenant, "slid" if slid else "fit").increment(1)

    def circuit_state(self, upstream: str, value: int):
        self._series("gateway_upstream_circuit_state", upstream).set(value)

    def circuit_transition(self, upstream: str, state: str):
        self._series("gateway_upstream_circuit_transitions_total", upstream, state).increment(1)

    def upstream_error(self, upstream: str, kind: str):
        self._series("gateway_upstream_errors_total", upstream, kind).increment(1)

    def gc_pause(self, generation: str, seconds: float):
        self._series("gateway_gc_pause_seconds_total", generation).increment(seconds)

    def loop_cpu(self, seconds: float):
        self._series("gateway_event_loop_cpu_seconds_total").increment(seconds)

    def fallback(self, requested: str, used: str):
        self._series("gateway_fallbacks_total", requested, used).increment(1)
