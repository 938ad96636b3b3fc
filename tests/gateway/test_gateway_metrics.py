"""The gateway's metric updates leave its event loop: recorded, then applied by a thread of their own; the
loop's own CPU time is counted from the loop."""
import asyncio
import threading
import time

import math

import pytest

from gateway.metrics import (FAMILIES, ITL_BUCKETS, AppliedInBackground, GatewayMetrics, LoopCpu, MemoryRegistry,
                             TritonRegistry)
from tests.support.wait import wait_until


class CountingRegistry(MemoryRegistry):
    """MemoryRegistry that counts the calls it is given (each one an IPC round trip in Triton) and their
    threads; `fail` names metrics whose calls raise."""

    def __init__(self, fail: str | None = None):
        super().__init__()
        self.calls, self.threads, self.fail = 0, set(), fail

    def metric(self, name: str, labels: dict):
        inner, registry = super().metric(name, labels), self

        class _Counted:
            def __getattr__(self, op):
                def call(v):
                    registry.calls += 1
                    registry.threads.add(threading.current_thread().name)
                    if name == registry.fail:
                        raise RuntimeError("the IPC failed")
                    getattr(inner, op)(v)
                return call

        return _Counted()


def test_updates_are_applied_coalesced_per_series_by_one_thread():
    inner = CountingRegistry()
    applied = AppliedInBackground(inner, interval_s=3600)  # no tick during the test: flush() applies
    m = GatewayMetrics(applied)
    for n in range(10):  # ten requests' worth of updates
        m.finished("acme", "tensorrt_llm", "success", n_in=5, n_out=7, cost=0.5)
        m.reserved("acme", 100 * n)
        m.ttft("acme", "tensorrt_llm", 0.01 * (n + 1))
    m.rejected("other", "rate_limited")
    assert inner.calls == 0  # recorded, not applied
    applied.flush()
    assert inner.value("gateway_requests_total", tenant="acme", model="tensorrt_llm", outcome="success") == 10
    assert inner.value("gateway_input_tokens_total", tenant="acme", model="tensorrt_llm") == 50
    assert inner.value("gateway_output_tokens_total", tenant="acme", model="tensorrt_llm") == 70
    assert inner.value("gateway_cost_total", tenant="acme", model="tensorrt_llm") == 5.0
    assert inner.value("gateway_reserved_tokens", tenant="acme") == 900  # a gauge: its last setting
    assert inner.value("gateway_rejections_total", tenant="other", reason="rate_limited") == 1
    ttft = inner.observations[("gateway_time_to_first_token_seconds", (("model", "tensorrt_llm"), ("tenant", "acme")))]
    assert ttft == [0.01 * (n + 1) for n in range(10)]  # a histogram is given every value, in order
    assert inner.calls == 4 + 1 + 1 + 1  # 4 counters and 1 gauge of acme, 1 of other, 10 observations at once
    applied.flush()
    assert inner.calls == 7  # nothing pending: nothing applied twice


def test_the_thread_applies_them_without_a_flush_and_survives_a_failing_metric():
    inner = CountingRegistry(fail="gateway_rejections_total")
    applied = AppliedInBackground(inner, interval_s=0.01)
    m = GatewayMetrics(applied)
    m.rejected("acme", "rate_limited")  # raises in the thread: logged, the thread goes on
    m.queue_depth("tensorrt_llm", 3)
    assert wait_until(lambda: inner.value("gateway_admission_queue_depth", model="tensorrt_llm") == 3, 5)
    m.queue_depth("tensorrt_llm", 0)
    assert wait_until(lambda: inner.value("gateway_admission_queue_depth", model="tensorrt_llm") == 0, 5)
    assert inner.threads == {"gateway-metrics"}  # never the caller's thread (the gateway's event loop)


def _loop_cpu_while(work) -> float:
    """gateway_event_loop_cpu_seconds_total counted by LoopCpu (ticking every 10 ms) on a loop while
    `work(loop)` runs, once a tick has followed it."""
    registry = MemoryRegistry()

    async def scenario():
        task = asyncio.ensure_future(LoopCpu(GatewayMetrics(registry), interval_s=0.01).run())
        await asyncio.sleep(0.02)
        await work()
        await asyncio.sleep(0.05)
        task.cancel()

    asyncio.run(scenario())
    return registry.value("gateway_event_loop_cpu_seconds_total")


def _burn(seconds: float) -> None:
    """Spend `seconds` of this thread's CPU (however long that takes on a busy host)."""
    start = time.thread_time()
    while time.thread_time() - start < seconds:
        pass


def test_the_event_loops_own_cpu_is_counted():
    async def busy():
        _burn(0.2)  # the loop's thread computes (an admit's Python, say)

    async def idle_beside_a_busy_thread():
        worker = threading.Thread(target=_burn, args=(0.2,))
        worker.start()
        while worker.is_alive():
            await asyncio.sleep(0.005)  # the loop waits: another thread's CPU is not the loop's

    assert _loop_cpu_while(busy) >= 0.2
    assert _loop_cpu_while(idle_beside_a_busy_thread) < 0.1


class FakeMetricFamilies:
    """`pb_utils.MetricFamily` as the gateway uses it, counting its metrics' calls (each an IPC round trip in
    Triton, made holding the stub's GIL); kinds are strings here."""

    def __init__(self):
        self.kinds, self.values, self.calls = {}, {}, 0
        families = self

        class MetricFamily:
            COUNTER, GAUGE, HISTOGRAM = "counter", "gauge", "histogram"

            def __init__(self, name, description, kind):
                assert description and name not in families.kinds
                self.name = name
                families.kinds[name] = kind

            def Metric(self, labels, buckets=None):  # noqa: N802 (pb_utils' name)
                assert buckets is None, "no Triton histogram: its observe is one IPC round trip per value"
                key, family = (self.name, tuple(sorted(labels.items()))), self

                class Metric:
                    def increment(self, v):
                        assert v >= 0 and families.kinds[family.name] == "counter"
                        families.calls += 1
                        families.values[key] = families.values.get(key, 0) + v

                    def set(self, v):
                        assert families.kinds[family.name] == "gauge"
                        families.calls += 1
                        families.values[key] = v

                return Metric()

        self.MetricFamily = MetricFamily

    def value(self, name, **labels):
        return self.values.get((name, tuple(sorted(labels.items()))))


@pytest.fixture
def triton():
    pb_utils = FakeMetricFamilies()
    return pb_utils, GatewayMetrics(AppliedInBackground(TritonRegistry(pb_utils), interval_s=3600))


def test_a_histogram_is_the_counters_prometheus_reads_one_as(triton):
    pb_utils, metrics = triton
    histograms = [n for n, spec in FAMILIES.items() if spec[0] == "histogram"]
    assert histograms and not any(n in pb_utils.kinds for n in histograms)
    # gauges set to the totals: prometheus-client would read a counter `..._count` as `..._count_total`
    assert all(pb_utils.kinds[n + s] == "gauge" for n in histograms for s in ("_bucket", "_sum", "_count"))
    observed = [0.004, 0.005, 0.006, 0.5, 0.5, 2.0, math.inf]
    for v in observed:
        metrics.itl("acme", "m", v)
    metrics.r.flush()
    series = {"tenant": "acme", "model": "m"}
    buckets = {le: pb_utils.value("gateway_inter_token_latency_seconds_bucket", le=le, **series)
               for le in [*map(repr, ITL_BUCKETS), "+Inf"]}
    # cumulative, as Prometheus's histograms: le="0.005" holds 0.004 and 0.005 (<=), "+Inf" all seven
    assert buckets == {"0.005": 2, "0.01": 3, "0.02": 3, "0.05": 3, "0.1": 3, "0.2": 3, "0.5": 5, "1.0": 5,
                       "+Inf": 7}
    assert pb_utils.value("gateway_inter_token_latency_seconds_count", **series) == 7
    assert pb_utils.value("gateway_inter_token_latency_seconds_sum", **series) == math.inf


def test_many_observations_cost_a_call_per_bucket_they_reach_not_one_each(triton):
    pb_utils, metrics = triton
    for n in range(1000):  # a thousand requests' queue waits between two ticks
        metrics.queue_wait("acme", 0.2 + n / 1e6)
    metrics.r.flush()
    # every value lands in le="0.25": that bucket, the 6 above it and +Inf, the sum and the count
    assert pb_utils.calls == 8 + 2
    assert pb_utils.value("gateway_queue_wait_seconds_bucket", tenant="acme", le="0.1") is None
    assert pb_utils.value("gateway_queue_wait_seconds_bucket", tenant="acme", le="0.25") == 1000
    assert pb_utils.value("gateway_queue_wait_seconds_count", tenant="acme") == 1000
    assert pb_utils.value("gateway_queue_wait_seconds_sum", tenant="acme") == pytest.approx(200.4995)
    metrics.queue_wait("acme", 20.0)
    metrics.r.flush()  # the next tick adds to what is there
    assert pb_utils.value("gateway_queue_wait_seconds_bucket", tenant="acme", le="30.0") == 1001
    assert pb_utils.value("gateway_queue_wait_seconds_bucket", tenant="acme", le="10.0") == 1000


def test_the_collectors_pauses_are_timed_and_published_from_the_loop():
    import gc

    from gateway.metrics import GcPauses

    registry, clock = MemoryRegistry(), [10.0]
    pauses = GcPauses(GatewayMetrics(registry), interval_s=0.01, clock=lambda: clock[0])
    try:
        pauses.timed("start", {"generation": 2})
        clock[0] += 0.04  # a full pass of 40 ms
        pauses.timed("stop", {"generation": 2, "collected": 0, "uncollectable": 0})
        pauses.timed("start", {"generation": 0})
        clock[0] += 0.001
        pauses.timed("stop", {"generation": 0, "collected": 3, "uncollectable": 0})

        async def two_ticks():
            task = asyncio.ensure_future(pauses.run())
            await asyncio.sleep(0.05)
            task.cancel()

        asyncio.run(two_ticks())
        assert registry.value("gateway_gc_pause_seconds_total", generation="2") == pytest.approx(0.04)
        assert registry.value("gateway_gc_pause_seconds_total", generation="0") == pytest.approx(0.001)
        assert registry.value("gateway_gc_pause_seconds_total", generation="1") == 0  # none: nothing published
    finally:
        gc.callbacks.remove(pauses.timed)
    real = GcPauses(GatewayMetrics(MemoryRegistry()))
    try:
        gc.collect()  # a real full pass reaches the callback
        assert real.seconds[2] > 0 and real._started is None
    finally:
        gc.callbacks.remove(real.timed)
