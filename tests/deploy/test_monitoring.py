"""Monitoring (issue 31): the recording rules, alerts and SLOs of build/monitoring.py, run through promtool
on synthetic series (every alert fires and resolves), the HPA's adapter query with and without the
gateway's gauge, and every query of the rules and the Grafana dashboard parsed by promtool and naming only
metrics that exist. (No Grafana here: neither PyPI nor npm ships its server; the panels are checked
through promtool instead.)"""
import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from gateway.metrics import FAMILIES, GatewayMetrics
from build import monitoring

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
PROMTOOL = shutil.which("promtool")
needs_promtool = pytest.mark.skipif(not PROMTOOL, reason="promtool not installed (build/system_deps.sh installs it)")


def promtool(*args, cwd=None):
    return subprocess.run([PROMTOOL, *map(str, args)], capture_output=True, text=True, cwd=cwd, timeout=120)


def k8s_docs():
    return [d for d in yaml.safe_load_all(monitoring.K8S_RULES.read_text()) if d]


def alerts_of(groups):
    return {r["alert"] for g in groups for r in g["rules"] if "alert" in r}


# --- one definition, shipped current ---------------------------------------------------------------
def test_the_shipped_rules_and_adapter_values_are_generated():
    for path, text in monitoring.shipped().items():
        assert path.read_text() == text, f"{path.name} is stale: python build/monitoring.py"
    rule, cm = k8s_docs()
    assert rule["kind"] == "PrometheusRule" and cm["kind"] == "ConfigMap"
    assert yaml.safe_load(cm["data"]["rules.yml"])["groups"] == rule["spec"]["groups"]  # the same rules twice
    compose = yaml.safe_load(monitoring.COMPOSE_RULES.read_text())["groups"]
    assert alerts_of(compose) | {"LLMPodOOMKilled", "LLMPodRestarting", "LLMReplicasUnavailable"} == \
        alerts_of(rule["spec"]["groups"])
    # the Prometheus that prometheus-scrape.yaml configures reads that ConfigMap's file
    scrape = next(d for d in yaml.safe_load_all((DEPLOY / "k8s" / "prometheus-scrape.yaml").read_text()) if d)
    assert yaml.safe_load(scrape["data"]["prometheus.yml"])["rule_files"] == ["/etc/prometheus/rules.yml"]
    assert cm["metadata"]["name"] in (DEPLOY / "k8s" / "prometheus-scrape.yaml").read_text()


def test_the_slo_is_a_knob(tmp_path):
    strict = monitoring.SLO(ttft_slo_seconds=1.0, ttft_slo_objective=0.995, availability_slo_objective=0.9995)
    rules = {r.get("record") or r.get("alert"): r for g in monitoring.groups(strict, "compose") for r in g["rules"]}
    assert 'le="1.0"' in rules["llm:slo_ttft_slow:ratio_rate5m"]["expr"]
    assert "(14.4 * 0.005)" in rules["LLMTTFTBudgetBurnFast"]["expr"]
    assert "(14.4 * 0.0005)" in rules["LLMErrorBudgetBurnFast"]["expr"]
    default = {r.get("alert"): r for g in monitoring.groups(monitoring.SLO(), "compose") for r in g["rules"]}
    assert "(14.4 * 0.001)" in default["LLMErrorBudgetBurnFast"]["expr"]
    with pytest.raises(ValueError, match="bucket"):
        monitoring.SLO(ttft_slo_seconds=1.7)  # not a histogram bucket: the ratio could not be computed
    with pytest.raises(ValueError, match="between 0 and 1"):
        monitoring.SLO(availability_slo_objective=1.0)
    assert monitoring.main(["--ttft-slo-seconds", "1.0", "--out-dir", str(tmp_path)]) == 0
    assert 'le="1.0"' in (tmp_path / "rules.yml").read_text()
    assert monitoring.main(["--ttft-slo-seconds", "3"]) == 2
    assert monitoring.main(["--check"]) == 0


def test_the_fail_open_gauge_says_when_no_limits_are_enforced():
    """The series LLMGatewayFailOpen reads: 1 only while the store is down under fail_open."""
    class Registry:
        def __init__(self):
            self.values = {}

        def metric(self, name, labels):
            registry = self

            class M:
                def set(self, v):
                    registry.values[name] = v
            return M()

    r = Registry()
    m = GatewayMetrics(r)
    m.backend_up(False, "fail_open")
    assert r.values == {"gateway_ratelimit_backend_up": 0, "gateway_ratelimit_fail_open_active": 1}
    m.backend_up(True, "fail_open")
    assert r.values["gateway_ratelimit_fail_open_active"] == 0
    m.backend_up(False, "fail_closed")
    assert r.values == {"gateway_ratelimit_backend_up": 0, "gateway_ratelimit_fail_open_active": 0}
    assert "gateway_ratelimit_fail_open_active" in FAMILIES


# --- promtool: every alert fires and resolves --------------------------------------------------------
def _covered(test_file: Path) -> tuple[set[str], set[str]]:
    fired, resolved = set(), set()
    for case in yaml.safe_load(test_file.read_text())["tests"]:
        for t in case.get("alert_rule_test", []):
            (fired if t["exp_alerts"] else resolved).add(t["alertname"])
    return fired, resolved


@needs_promtool
def test_promtool_checks_and_tests_the_compose_rules():
    out = promtool("check", "rules", monitoring.COMPOSE_RULES)
    assert out.returncode == 0, out.stdout + out.stderr
    out = promtool("test", "rules", DEPLOY / "prometheus" / "rules.test.yml")
    assert out.returncode == 0, out.stdout + out.stderr
    fired, resolved = _covered(DEPLOY / "prometheus" / "rules.test.yml")
    every = alerts_of(yaml.safe_load(monitoring.COMPOSE_RULES.read_text())["groups"])
    assert every - fired == set(), "alerts never seen firing"
    assert every - resolved == set(), "alerts never seen resolved"


@needs_promtool
def test_promtool_checks_and_tests_the_kubernetes_rules(tmp_path):
    rule, cm = k8s_docs()
    (tmp_path / "rules.yml").write_text(cm["data"]["rules.yml"])
    shutil.copy(DEPLOY / "k8s" / "prometheus-rules.test.yml", tmp_path / "rules.test.yml")
    out = promtool("check", "rules", tmp_path / "rules.yml")
    assert out.returncode == 0, out.stdout + out.stderr
    out = promtool("test", "rules", tmp_path / "rules.test.yml")
    assert out.returncode == 0, out.stdout + out.stderr
    # the shared groups are the compose tests' (same expressions but the Triton selector), run here too
    compose_tests = yaml.safe_load((DEPLOY / "prometheus" / "rules.test.yml").read_text())
    for case in compose_tests["tests"]:  # relabel the compose job to the pod label of Kubernetes
        for s in case["input_series"]:
            s["series"] = s["series"].replace('job="triton"', 'job="triton", app="triton-llm"')
        for t in case.get("alert_rule_test", []):
            for a in t["exp_alerts"]:
                if "job" in a["exp_labels"] and a["exp_labels"]["job"] == "triton":
                    a["exp_labels"]["app"] = "triton-llm"
    (tmp_path / "shared.test.yml").write_text(yaml.safe_dump(compose_tests, sort_keys=False))
    out = promtool("test", "rules", tmp_path / "shared.test.yml")
    assert out.returncode == 0, out.stdout + out.stderr
    fired, resolved = _covered(DEPLOY / "k8s" / "prometheus-rules.test.yml")
    fired2, resolved2 = _covered(DEPLOY / "prometheus" / "rules.test.yml")
    every = alerts_of(rule["spec"]["groups"])
    assert every - fired - fired2 == set() and every - resolved - resolved2 == set()


# --- issue 31, item 4: the queue depth has a value before the gateway's first request -----------------
QUEUE_CASE = """
rule_files: [rules.yml]
evaluation_interval: 1m
tests:
  - interval: 1m
    input_series:
      - series: 'nv_trt_llm_request_metrics{request_type="waiting", model="tensorrt_llm", version="1", namespace="llm", pod="triton-llm-a"}'
        values: '12x5'
      - series: 'nv_trt_llm_request_metrics{request_type="waiting", model="tensorrt_llm", version="1", namespace="llm", pod="triton-llm-b"}'
        values: '3x5'
      - series: 'gateway_admission_queue_depth{model="tensorrt_llm", namespace="llm", pod="triton-llm-b"}'
        values: '20x5'
    promql_expr_test:
      - expr: hpa:llm_queue_depth
        eval_time: 2m
        exp_samples:
          - {labels: 'hpa:llm_queue_depth{namespace="llm", pod="triton-llm-a"}', value: 12}
          - {labels: 'hpa:llm_queue_depth{namespace="llm", pod="triton-llm-b"}', value: 23}
"""


def _adapter_query(metrics_query: str) -> str:
    """The query prometheus-adapter sends for the HPA's pods (its template filled as it fills it)."""
    return (metrics_query.replace("<<.GroupBy>>", "namespace,pod")
            .replace("<<.LabelMatchers>>", 'namespace="llm",pod=~"triton-llm-a|triton-llm-b"'))


@needs_promtool
def test_the_hpa_queue_metric_has_a_value_per_pod_without_the_gateway_gauge(tmp_path):
    adapter = yaml.safe_load(monitoring.ADAPTER_VALUES.read_text())["rules"]["custom"]
    queue = next(r for r in adapter if r["name"]["as"] == monitoring.HPA_QUEUE_METRIC)

    def run(expr):
        (tmp_path / "rules.yml").write_text(yaml.safe_dump(
            {"groups": [{"name": "hpa", "rules": [{"record": "hpa:llm_queue_depth", "expr": expr}]}]}))
        (tmp_path / "t.yml").write_text(QUEUE_CASE)
        return promtool("test", "rules", tmp_path / "t.yml")

    out = run(_adapter_query(queue["metricsQuery"]))
    assert out.returncode == 0, out.stdout + out.stderr
    # the query before the fix: pod a, whose gateway has not served yet, had no value at all
    before = ('sum by (<<.GroupBy>>) (nv_trt_llm_request_metrics{request_type="waiting",<<.LabelMatchers>>}) + '
              'sum by (<<.GroupBy>>) (gateway_admission_queue_depth{<<.LabelMatchers>>})')
    out = run(_adapter_query(before))
    assert out.returncode != 0 and "triton-llm-a" in out.stdout + out.stderr


# --- every query parses and names only metrics that exist --------------------------------------------
def _dashboard_exprs():
    d = json.loads((DEPLOY / "grafana" / "dashboards" / "llm-serving.json").read_text())
    return [(p["title"], t["expr"]) for p in d["panels"] for t in p["targets"]]


def _series_names(expr: str) -> set[str]:
    """Metric names in a PromQL expression: identifiers not followed by `(` that are not keywords, label
    names inside braces, or durations."""
    text = re.sub(r'"[^"]*"', '""', expr)  # label values and strings
    text = re.sub(r"\{[^}]*\}", "{}", text)  # matchers
    text = re.sub(r"\[[^\]]*\]", "[]", text)  # ranges
    text = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", "", text)
    words = [w for w, call in re.findall(r"([A-Za-z_:][A-Za-z0-9_:]*)(\s*\()?", text) if not call]
    keywords = {"and", "or", "unless", "bool", "offset", "vector", "inf", "nan"}
    return {w for w in words if w.lower() not in keywords}


@needs_promtool
def test_every_dashboard_panel_parses_with_promtool(tmp_path):
    exprs = _dashboard_exprs()
    rules = [{"record": f"panel:{i}", "expr": e} for i, (_, e) in enumerate(exprs)]
    (tmp_path / "panels.yml").write_text(yaml.safe_dump({"groups": [{"name": "panels", "rules": rules}]}))
    out = promtool("check", "rules", tmp_path / "panels.yml")
    assert out.returncode == 0, out.stdout + out.stderr
    (tmp_path / "bad.yml").write_text(yaml.safe_dump({"groups": [{"name": "x", "rules": [
        {"record": "panel:bad", "expr": "sum by (tenant (rate(x[5m]))"}]}]}))
    assert promtool("check", "rules", tmp_path / "bad.yml").returncode != 0  # the check can fail


def front_metric_names() -> set[str]:
    """The front's own series (front/metrics.py), which the dashboard reads from its 9002 (the build
    package may not import the front: tests/test_layering.py)."""
    from front.metrics import FrontMetrics

    names = set()
    for family in FrontMetrics().registry.collect():
        if family.type == "histogram":
            names |= {family.name + s for s in ("_bucket", "_sum", "_count")}
        else:
            names.add(family.name + ("_total" if family.type == "counter" else ""))
    return names


def test_every_query_names_only_metrics_that_exist():
    known = monitoring.known_metrics() | front_metric_names()
    assert "llm_front_lease_operation_seconds_bucket" in known and "llm_front_admits_total" in known
    queries = _dashboard_exprs()
    for path in (monitoring.COMPOSE_RULES,):
        queries += [(r.get("record") or r["alert"], r["expr"])
                    for g in yaml.safe_load(path.read_text())["groups"] for r in g["rules"]]
    queries += [(r["record"] if "record" in r else r["alert"], r["expr"]) for g in k8s_docs()[0]["spec"]["groups"]
                for r in g["rules"]]
    queries += [(r["name"]["as"], r["metricsQuery"]) for r in
                yaml.safe_load(monitoring.ADAPTER_VALUES.read_text())["rules"]["custom"]]
    assert len(queries) > 40
    for where, expr in queries:
        unknown = _series_names(expr) - known
        assert not unknown, f"{where}: {sorted(unknown)} exist nowhere"
    assert _series_names('sum by (le) (rate(not_a_metric_total{a="b"}[5m])) > 0') == {"not_a_metric_total"}
    # label values of the backend's families are upstream's
    families = monitoring.trtllm_families()
    for where, expr in queries:
        for family, label, value in re.findall(r'(nv_trt_llm_\w+)\{[^}]*?(\w+)=~?"([^"]+)"', expr):
            if label == families[family]["label"]:
                assert set(value.split("|")) <= set(families[family]["values"]), (where, value)
    # the panels the operators need are there
    exprs = " ".join(e for _, e in _dashboard_exprs())
    for needed in ("llm:slo_errors:ratio_rate", "llm:slo_ttft_slow:ratio_rate", "gateway_ratelimit_fail_open_active",
                   "llm:gpu_memory_used_fraction", "gateway_lora_weights_sent_total"):
        assert needed in exprs, needed


def test_the_dcgm_fields_the_alerts_read_are_exported():
    fields = monitoring.dcgm_fields()
    assert {"DCGM_FI_DEV_XID_ERRORS", "DCGM_FI_DEV_ECC_DBE_VOL_TOTAL", "DCGM_FI_DEV_FB_USED", "DCGM_FI_DEV_FB_FREE",
            "DCGM_FI_DEV_GPU_UTIL", "DCGM_FI_DEV_UNCORRECTABLE_REMAPPED_ROWS"} <= fields
    compose = yaml.safe_load((DEPLOY / "docker-compose.yml").read_text())["services"]["dcgm-exporter"]
    inside = compose["environment"]["DCGM_EXPORTER_COLLECTORS"]
    assert f"./dcgm/counters.csv:{inside}:ro" in compose["volumes"]


def test_every_slo_knob_is_documented_with_its_default():
    from dataclasses import fields

    doc = (ROOT / "docs" / "operations.md").read_text()
    for f in fields(monitoring.SLO):
        row = f"| `--{f.name.replace('_', '-')}` | {f.default:g} |"
        assert row in doc, row
    for alert in alerts_of(monitoring.groups(monitoring.SLO(), "k8s")):
        assert f"`{alert}`" in doc or f"`{alert.removesuffix('Fast').removesuffix('Slow')}" in doc, alert
