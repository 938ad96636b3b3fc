"""Prometheus recording rules, alerts and the HPA's adapter rules of the serving stack, defined once and
written for each target.

    python build/monitoring.py            # rewrite rules.yml, prometheus-rules.yaml, prometheus-adapter-values.yaml
    python build/monitoring.py --check    # exit 1 if a shipped file is not what this would write
    python build/monitoring.py --ttft-slo-seconds 1.0 --ttft-slo-objective 0.995 --availability-slo-objective 0.999 \
        --out-dir <folder>            # the same rules for other SLOs (SLO class below: every knob)

Compose's Prometheus reads `deploy/prometheus/rules.yml`; Kubernetes gets the same groups twice in
`deploy/k8s/prometheus-rules.yaml`: a PrometheusRule (clusters with the Prometheus operator) and the
ConfigMap `llm-prometheus-rules` whose `rules.yml` is the file `prometheus-scrape.yaml` names, plus a group
of pod alerts from kube-state-metrics that compose has no source for. `promtool test rules` runs
`deploy/prometheus/rules.test.yml` (every alert fires and resolves on synthetic series;
tests/deploy/test_monitoring.py).

SLOs are multi-window, multi-burn-rate (Google's SRE workbook, "Alerting on SLOs"): a page when the error
budget of the SLO period burns 14.4x over 1 h and 5 min, or 6x over 6 h and 30 min; a ticket at 3x over
1 d and 2 h, or 1x over 3 d and 6 h. The long window says it matters, the short one that it is still
happening (so the alert resolves minutes after the burn stops).

Sums use `or vector(0)` / `label_replace(...) or ...` where a series may not exist yet: in PromQL an
operation with an empty vector is empty, so `a + b` has no value while the gateway's gauge has never been
set (before its first request) and an alert on it could never fire.
"""
from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass, fields
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from gateway.metrics import HISTOGRAM_SERIES, LATENCY_BUCKETS, bucket_label  # noqa: E402
from contracts.errors import KINDS  # noqa: E402

COMPOSE_RULES = ROOT / "deploy" / "prometheus" / "rules.yml"
K8S_RULES = ROOT / "deploy" / "k8s" / "prometheus-rules.yaml"
ADAPTER_VALUES = ROOT / "deploy" / "k8s" / "prometheus-adapter-values.yaml"
# the HPA's per-pod metrics (deploy/k8s/triton.yaml), served by prometheus-adapter
HPA_QUEUE_METRIC = "llm_queue_depth"
HPA_GPU_METRIC = "llm_gpu_utilization"
# server-side failures among the gateway's rejections: the 5xx kinds (contracts/errors.py); 4xx are the
# client's (bad input, auth, limits) and burn no budget
SERVER_ERROR_KINDS = tuple(k for k, v in KINDS.items() if v.status >= 500)
# (long window, short window, burn factor): SRE workbook table 5-8
PAGE_WINDOWS = (("1h", "5m", 14.4), ("6h", "30m", 6.0))
TICKET_WINDOWS = (("1d", "2h", 3.0), ("3d", "6h", 1.0))
WINDOWS = ("5m", "30m", "1h", "2h", "6h", "1d", "3d")
# where each target's Prometheus finds Triton's metrics port (compose: the scrape job; Kubernetes: the pod
# label prometheus-scrape.yaml copies and podmonitor.yaml's podTargetLabels keeps)
TRITON_SELECTOR = {"compose": 'job="triton"', "k8s": 'app="triton-llm"'}
POD_REGEX = "triton-llm-.*"  # the Deployment's pods (deploy/k8s/triton.yaml)


@dataclass(frozen=True)
class SLO:
    """The knobs of the rules (docs/operations.md lists them with these defaults)."""
    ttft_slo_seconds: float = 2.5  # a request's first token later than this is slow (a TTFT histogram bucket)
    ttft_slo_objective: float = 0.99  # the share of requests whose first token comes within ttft_slo_seconds
    availability_slo_objective: float = 0.999  # the share of requests that do not fail on the server's side
    queue_backlog: int = 32  # requests waiting (engine + gateway admission) that count as a backlog
    kv_cache_full_fraction: float = 0.95
    gpu_memory_full_fraction: float = 0.98  # TensorRT-LLM holds ~90% of free memory for KV: alert above that
    gateway_loop_busy_fraction: float = 0.85  # of a core, the gateway's event loop's CPU over 5 min
    lora_evicted_fraction: float = 0.2  # of an engine's adapter requests, those that resent evicted weights

    def __post_init__(self):
        if self.ttft_slo_seconds not in LATENCY_BUCKETS:
            raise ValueError(f"ttft_slo_seconds must be a bucket of gateway_time_to_first_token_seconds "
                             f"({', '.join(map(str, LATENCY_BUCKETS))}), got {self.ttft_slo_seconds}")
        for name in ("ttft_slo_objective", "availability_slo_objective", "kv_cache_full_fraction",
                     "gpu_memory_full_fraction", "gateway_loop_busy_fraction", "lora_evicted_fraction"):
            if not 0 < getattr(self, name) < 1:
                raise ValueError(f"{name} must be between 0 and 1, got {getattr(self, name)}")
        if self.queue_backlog < 1:
            raise ValueError(f"queue_backlog must be positive, got {self.queue_backlog}")


def queue_depth_expr(engine_matchers: str = "", gateway_matchers: str = "", by: str = "") -> str:
    """Engine waiting requests + the gateway's admission queue; either may be absent (the gateway's gauge
    until its first request, the engine's on a CPU repository): each side is kept apart by a `queue` label,
    so `or` never drops one for the other, and the sum has a value whenever either exists."""
    engine = f'nv_trt_llm_request_metrics{{request_type="waiting"{"," + engine_matchers if engine_matchers else ""}}}'
    gateway = "gateway_admission_queue_depth" + (f"{{{gateway_matchers}}}" if gateway_matchers else "")
    group = f" by ({by})" if by else ""
    return (f'sum{group} (label_replace({engine}, "queue", "engine", "", "") or '
            f'label_replace({gateway}, "queue", "gateway", "", ""))')


def _ratio_rules(slo: SLO) -> list[dict]:
    server = "|".join(SERVER_ERROR_KINDS)
    out = []
    for w in WINDOWS:
        errors = (f'(sum(rate(gateway_requests_total{{outcome="error"}}[{w}])) or vector(0)) + '
                  f'(sum(rate(gateway_rejections_total{{reason=~"{server}"}}[{w}])) or vector(0))')
        total = (f"(sum(rate(gateway_requests_total[{w}])) or vector(0)) + "
                 f"(sum(rate(gateway_rejections_total[{w}])) or vector(0))")
        out.append({"record": f"llm:slo_errors:ratio_rate{w}", "expr": f"({errors}) / ({total})"})
    for w in WINDOWS:
        le = bucket_label(slo.ttft_slo_seconds)
        out.append({"record": f"llm:slo_ttft_slow:ratio_rate{w}",
                    "expr": f'1 - (sum(rate(gateway_time_to_first_token_seconds_bucket{{le="{le}"}}[{w}])) / '
                            f"sum(rate(gateway_time_to_first_token_seconds_count[{w}])))"})
    return out


def _burn_alert(name: str, ratio: str, objective: float, windows, severity: str, for_: str, what: str) -> dict:
    budget = round(1 - objective, 6)
    expr = " or ".join(f"(llm:{ratio}:ratio_rate{long} > ({factor} * {budget}) and "
                       f"llm:{ratio}:ratio_rate{short} > ({factor} * {budget}))" for long, short, factor in windows)
    return {"alert": name, "expr": expr, "for": for_, "labels": {"severity": severity},
            "annotations": {"summary": f"{what}: the {objective:.2%} SLO's error budget burns at "
                                       + " or ".join(f"{f:g}x over {lw} and {sw}" for lw, sw, f in windows)}}


def groups(slo: SLO, target: str) -> list[dict]:
    """The rule groups for `target` (compose | k8s)."""
    triton = TRITON_SELECTOR[target]
    recording = [
        {"record": "llm:output_tokens:rate1m", "expr": "sum by (tenant) (rate(gateway_output_tokens_total[1m]))"},
        {"record": "llm:ttft_seconds:p95",
         "expr": "histogram_quantile(0.95, sum by (le, tenant) (rate(gateway_time_to_first_token_seconds_bucket[5m])))"},
        {"record": "llm:itl_seconds:p95",
         "expr": "histogram_quantile(0.95, sum by (le, tenant) (rate(gateway_inter_token_latency_seconds_bucket[5m])))"},
        {"record": "llm:engine_waiting_requests", "expr": queue_depth_expr()},
        {"record": "llm:kv_cache_used_fraction",
         "expr": 'max(nv_trt_llm_kv_cache_block_metrics{kv_cache_block_type="fraction"})'},
        {"record": "llm:gpu_memory_used_fraction",
         "expr": "max by (gpu, Hostname) (DCGM_FI_DEV_FB_USED / (DCGM_FI_DEV_FB_USED + DCGM_FI_DEV_FB_FREE))"},
        *_ratio_rules(slo),
    ]
    serving = [
        {"alert": "LLMQueueBacklog", "expr": f"llm:engine_waiting_requests > {slo.queue_backlog}", "for": "2m",
         "labels": {"severity": "warning"},
         "annotations": {"summary": "Requests are queueing for the engine ({{ $value }} waiting)"}},
        {"alert": "LLMKVCacheFull", "expr": f"llm:kv_cache_used_fraction > {slo.kv_cache_full_fraction}",
         "for": "5m", "labels": {"severity": "warning"},
         "annotations": {"summary": f"KV cache above {slo.kv_cache_full_fraction:.0%} for 5 minutes"}},
        {"alert": "RateLimitStoreDown", "expr": "min(gateway_ratelimit_backend_up) == 0", "for": "1m",
         "labels": {"severity": "critical"},
         "annotations": {"summary": "The gateway cannot reach Redis; the fail policy is in force"}},
        {"alert": "LLMGatewayFailOpen", "expr": "max(gateway_ratelimit_fail_open_active) == 1", "for": "1m",
         "labels": {"severity": "critical"},
         "annotations": {"summary": "A gateway admits without rate limits (Redis unreachable, fail policy "
                                    "fail_open): each replica enforces nothing until Redis answers"}},
        {"alert": "LLMGatewayLoopSaturated",
         "expr": f"max by (instance) (rate(gateway_event_loop_cpu_seconds_total[5m])) > {slo.gateway_loop_busy_fraction}",
         "for": "10m", "labels": {"severity": "warning"},
         "annotations": {"summary": "The gateway on {{ $labels.instance }} keeps its event loop busy {{ $value | "
                                    "humanizePercentage }} of a core: it admits and settles every request of its "
                                    "server in one process, so more requests a second wait for their admit and "
                                    "the time to first token grows; add a replica (docs/operations.md)"}},
        {"alert": "LLMLoRACacheThrashing",
         "expr": 'sum by (model) (rate(gateway_lora_weights_sent_total{reason="evicted"}[15m])) / '
                 f"sum by (model) (rate(gateway_adapter_requests_total[15m])) > {slo.lora_evicted_fraction}",
         "for": "15m", "labels": {"severity": "warning"},
         "annotations": {"summary": "{{ $value | humanizePercentage }} of the adapter requests of {{ $labels.model }} "
                                    "sent their LoRA weights again because the engine had evicted them: its LoRA "
                                    "cache holds fewer adapters than are in use, so each of those copies the "
                                    "weights into the engine again and streams through the gateway, not the "
                                    "front; raise lora_cache_host_memory_bytes (docs/lora.md)"}},
        {"alert": "LLMUpstreamCircuitOpen", "expr": "max by (upstream) (gateway_upstream_circuit_state) >= 1",
         "for": "5m", "labels": {"severity": "warning"},
         "annotations": {"summary": "The circuit of upstream provider {{ $labels.upstream }} has not closed for 5 "
                                    "minutes: its requests go to their fallbacks (docs/gateway.md, Upstream providers)"}},
        {"alert": "LLMEngineDown",
         "expr": f"(up{{{triton}}} == 0) or (up{{{triton}}} == 1 unless on (instance) "
                 f'nv_trt_llm_request_metrics{{request_type="max"}})',
         "for": "2m", "labels": {"severity": "critical"},
         "annotations": {"summary": "Triton on {{ $labels.instance }} is down or serves no TensorRT-LLM engine"}},
        _burn_alert("LLMErrorBudgetBurnFast", "slo_errors", slo.availability_slo_objective, PAGE_WINDOWS,
                    "critical", "2m", "Server-side errors"),
        _burn_alert("LLMErrorBudgetBurnSlow", "slo_errors", slo.availability_slo_objective, TICKET_WINDOWS,
                    "warning", "15m", "Server-side errors"),
        _burn_alert("LLMTTFTBudgetBurnFast", "slo_ttft_slow", slo.ttft_slo_objective, PAGE_WINDOWS,
                    "critical", "2m", f"Time to first token over {slo.ttft_slo_seconds:g} s"),
        _burn_alert("LLMTTFTBudgetBurnSlow", "slo_ttft_slow", slo.ttft_slo_objective, TICKET_WINDOWS,
                    "warning", "15m", f"Time to first token over {slo.ttft_slo_seconds:g} s"),
    ]
    gpu = [
        {"alert": "GPUXidError", "expr": "max by (gpu, Hostname) (DCGM_FI_DEV_XID_ERRORS) > 0",
         "labels": {"severity": "critical"},
         "annotations": {"summary": "GPU {{ $labels.gpu }} on {{ $labels.Hostname }} reported Xid {{ $value }} "
                                    "(docs/operations.md: which Xids mean drain the node)"}},
        {"alert": "GPUUncorrectableMemoryError",
         "expr": "(max by (gpu, Hostname) (increase(DCGM_FI_DEV_ECC_DBE_VOL_TOTAL[10m])) > 0) or "
                 "(max by (gpu, Hostname) (increase(DCGM_FI_DEV_UNCORRECTABLE_REMAPPED_ROWS[10m])) > 0) or "
                 "(max by (gpu, Hostname) (DCGM_FI_DEV_ROW_REMAP_FAILURE) > 0)",
         "labels": {"severity": "critical"},
         "annotations": {"summary": "GPU {{ $labels.gpu }} on {{ $labels.Hostname }}: uncorrectable ECC error or "
                                    "failed row remap (deploy/dcgm/counters.csv enables the ECC counters)"}},
        {"alert": "GPUMemoryNearlyFull",
         "expr": f"llm:gpu_memory_used_fraction > {slo.gpu_memory_full_fraction}", "for": "10m",
         "labels": {"severity": "warning"},
         "annotations": {"summary": "GPU {{ $labels.gpu }} on {{ $labels.Hostname }} memory above "
                                    f"{slo.gpu_memory_full_fraction:.0%} for 10 minutes, beyond the KV cache's "
                                    "reservation: an out-of-memory error is near"}},
    ]
    out = [{"name": "llm-recording", "rules": recording}, {"name": "llm-serving", "rules": serving},
           {"name": "llm-gpu", "rules": gpu}]
    if target == "k8s":
        pod = f'namespace!="", pod=~"{POD_REGEX}"'
        out.append({"name": "llm-pods", "rules": [
            {"alert": "LLMPodOOMKilled",
             "expr": f'(max by (namespace, pod, container) (kube_pod_container_status_last_terminated_reason{{reason="OOMKilled", {pod}}}) == 1) '
                     f"and on (namespace, pod, container) "
                     f"(increase(kube_pod_container_status_restarts_total{{{pod}}}[15m]) > 0)",
             "labels": {"severity": "critical"},
             "annotations": {"summary": "{{ $labels.pod }}/{{ $labels.container }} was OOM-killed"}},
            {"alert": "LLMPodRestarting",
             "expr": f"increase(kube_pod_container_status_restarts_total{{{pod}}}[30m]) >= 3",
             "labels": {"severity": "warning"},
             "annotations": {"summary": "{{ $labels.pod }}/{{ $labels.container }} restarted {{ $value }} times "
                                        "in 30 minutes"}},
            {"alert": "LLMReplicasUnavailable",
             "expr": 'kube_deployment_status_replicas_available{deployment="triton-llm"} '
                     '< kube_deployment_spec_replicas{deployment="triton-llm"}',
             "for": "15m", "labels": {"severity": "warning"},
             "annotations": {"summary": "triton-llm has {{ $value }} available replicas, fewer than it wants, "
                                        "for 15 minutes (a GPU short, a crash loop, a rollout stuck)"}},
        ]})
    return out


# --- the metrics that exist: what rules, the HPA and the dashboard may name -----------------------------
DCGM_COUNTERS = ROOT / "deploy" / "dcgm" / "counters.csv"
UPSTREAM_FACTS = ROOT / "build" / "upstream" / "tensorrt_llm_backend.json"
# kube-state-metrics' pod and deployment metrics the k8s alerts read (its docs/metrics/workload/*.md)
KUBE_STATE_METRICS = ("kube_pod_container_status_last_terminated_reason", "kube_pod_container_status_restarts_total",
                      "kube_deployment_status_replicas_available", "kube_deployment_spec_replicas")
PROMETHEUS_METRICS = ("up",)  # Prometheus' own per target


def dcgm_fields() -> set[str]:
    """The DCGM fields dcgm-exporter exports with deploy/dcgm/counters.csv."""
    lines = (line.split(",")[0].strip() for line in DCGM_COUNTERS.read_text().splitlines())
    return {f for f in lines if f and not f.startswith("#")}


def trtllm_families() -> dict[str, dict]:
    import json

    return json.loads(UPSTREAM_FACTS.read_text())["metrics"]["families"]


def known_metrics() -> set[str]:
    """Every series name a query here may use: the gateway's families (gateway/metrics.py; histograms
    as _bucket/_sum/_count), the tensorrtllm backend's (upstream facts), DCGM's (counters.csv),
    kube-state-metrics', Prometheus' `up`, and the recording rules defined above."""
    from gateway.metrics import FAMILIES

    names = set(PROMETHEUS_METRICS) | set(KUBE_STATE_METRICS) | dcgm_fields()
    for families in (FAMILIES, {k: (v["kind"],) for k, v in trtllm_families().items()}):
        for name, spec in families.items():
            names |= {name + s for s in HISTOGRAM_SERIES} if spec[0] == "histogram" else {name}
    names |= {r["record"] for g in groups(SLO(), "k8s") for r in g["rules"] if "record" in r}
    return names


def _dump(data) -> str:
    return yaml.safe_dump(data, sort_keys=False, width=10_000, allow_unicode=True)


def compose_rules(slo: SLO = SLO()) -> str:
    return ("# Generated by build/monitoring.py (the rules are defined there, once): do not edit.\n"
            "# promtool test rules deploy/prometheus/rules.test.yml\n" + _dump({"groups": groups(slo, "compose")}))


def k8s_rules(slo: SLO = SLO()) -> str:
    gs = groups(slo, "k8s")
    rule = {"apiVersion": "monitoring.coreos.com/v1", "kind": "PrometheusRule",
            "metadata": {"name": "llm-serving", "labels": {"app": "triton-llm"}}, "spec": {"groups": gs}}
    cm = {"apiVersion": "v1", "kind": "ConfigMap",
          "metadata": {"name": "llm-prometheus-rules", "labels": {"app.kubernetes.io/name": "prometheus"}},
          "data": {"rules.yml": _dump({"groups": gs})}}
    return ("# Generated by build/monitoring.py (the rules are defined there, once): do not edit.\n"
            "# The same rule groups twice: a PrometheusRule for the Prometheus operator, and the ConfigMap whose\n"
            "# rules.yml prometheus-scrape.yaml's Prometheus reads (mount it at /etc/prometheus/rules.yml).\n"
            "# The llm-pods group needs kube-state-metrics; llm-gpu needs dcgm-exporter (deploy/dcgm/counters.csv).\n"
            + _dump(rule) + "---\n" + _dump(cm))


def adapter_values() -> str:
    """prometheus-adapter's Helm values: the HPA's two per-pod metrics. Both need the `namespace` and `pod`
    labels of the pod they describe: prometheus-scrape.yaml / podmonitor.yaml attach them to Triton's
    series; dcgm-exporter attaches them to a GPU's series when it maps GPUs to pods (its default on
    Kubernetes; scrape it with honorLabels so they are kept)."""
    def resources():
        return {"overrides": {"namespace": {"resource": "namespace"}, "pod": {"resource": "pod"}}}

    matchers = "<<.LabelMatchers>>"
    rules = [
        {"seriesQuery": 'nv_trt_llm_request_metrics{request_type="waiting",namespace!="",pod!=""}',
         "resources": resources(), "name": {"as": HPA_QUEUE_METRIC},
         "metricsQuery": queue_depth_expr(matchers, matchers, "<<.GroupBy>>")},
        {"seriesQuery": 'DCGM_FI_DEV_GPU_UTIL{namespace!="",pod!=""}', "resources": resources(),
         "name": {"as": HPA_GPU_METRIC}, "metricsQuery": f"avg by (<<.GroupBy>>) (DCGM_FI_DEV_GPU_UTIL{{{matchers}}})"},
    ]
    return ("# Generated by build/monitoring.py (the queue-depth expression is defined there, once): do not edit.\n"
            "# Helm values for prometheus-adapter: the per-pod metrics of the HPA in triton.yaml. llm_queue_depth is the\n"
            "# engine's waiting requests plus the gateway's admission queue, with a value as soon as either exists (a sum\n"
            "# with a missing series is empty in PromQL: the HPA would report 'unable to get metric' until the first\n"
            "# gateway request); llm_gpu_utilization is DCGM's, per pod.\n" + _dump({"rules": {"custom": rules}}))


def shipped(slo: SLO = SLO()) -> dict[Path, str]:
    return {COMPOSE_RULES: compose_rules(slo), K8S_RULES: k8s_rules(slo), ADAPTER_VALUES: adapter_values()}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--check", action="store_true", help="exit 1 if a shipped file differs from what would be written")
    p.add_argument("--out-dir", type=Path, help="write rules.yml and prometheus-rules.yaml here instead")
    for f in fields(SLO):
        p.add_argument("--" + f.name.replace("_", "-"), type=type(f.default), default=f.default)
    args = p.parse_args(argv)
    try:
        slo = SLO(**{f.name: getattr(args, f.name) for f in fields(SLO)})
    except ValueError as e:
        print(f"monitoring: error: {e}", file=sys.stderr)
        return 2
    files = shipped(slo)
    if args.check:
        stale = [str(path.relative_to(ROOT)) for path, text in files.items()
                 if not path.exists() or path.read_text() != text]
        if stale:
            print(f"monitoring: stale: {', '.join(stale)} (python build/monitoring.py)", file=sys.stderr)
            return 1
        return 0
    for path, text in files.items():
        dest = args.out_dir / path.name if args.out_dir else path
        dest.parent.mkdir(parents=True, exist_ok=True)
        dest.write_text(text)
        print(f"monitoring: wrote {dest}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
