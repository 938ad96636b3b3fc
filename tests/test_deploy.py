"""deploy/: compose, Prometheus config and rules (promtool), Grafana provisioning and dashboard,
Kubernetes manifests. Validated structurally (no Docker engine or cluster here) and with promtool."""
import json
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from build import versions

DEPLOY = Path(__file__).resolve().parents[1] / "deploy"


def test_compose_services_images_and_ports():
    c = yaml.safe_load((DEPLOY / "docker-compose.yml").read_text())
    s = c["services"]
    assert set(s) == {"triton", "dcgm-exporter", "prometheus", "grafana"}
    assert s["triton"]["image"] == versions.TRITON_IMAGE
    assert s["dcgm-exporter"]["image"] == versions.DCGM_EXPORTER_IMAGE
    assert s["prometheus"]["image"] == versions.PROMETHEUS_IMAGE and s["grafana"]["image"] == versions.GRAFANA_IMAGE
    assert {"8000:8000", "8001:8001", "8002:8002"} <= set(s["triton"]["ports"])
    assert "--allow-gpu-metrics=true" in s["triton"]["command"]
    assert any("header-forward" in a for a in s["triton"]["command"])
    for svc in ("triton", "dcgm-exporter"):
        assert s[svc]["deploy"]["resources"]["reservations"]["devices"][0]["capabilities"] == ["gpu"]
    for vol in s["prometheus"]["volumes"] + s["grafana"]["volumes"]:
        assert (DEPLOY / vol.split(":")[0]).exists(), vol


def test_prometheus_scrapes_triton_and_dcgm():
    cfg = yaml.safe_load((DEPLOY / "prometheus" / "prometheus.yml").read_text())
    targets = {j["job_name"]: j["static_configs"][0]["targets"] for j in cfg["scrape_configs"]}
    assert targets == {"triton": ["triton:8002"], "dcgm": ["dcgm-exporter:9400"]}


@pytest.mark.skipif(not shutil.which("promtool"), reason="promtool not installed (build/system_deps.sh installs it)")
def test_rules_pass_promtool():
    out = subprocess.run(["promtool", "check", "rules", str(DEPLOY / "prometheus" / "rules.yml")],
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr


def test_dashboard_panels_query_known_metrics():
    d = json.loads((DEPLOY / "grafana" / "dashboards" / "llm-serving.json").read_text())
    assert d["uid"] and d["panels"]
    ids = [p["id"] for p in d["panels"]]
    assert len(ids) == len(set(ids))
    exprs = " ".join(t["expr"] for p in d["panels"] for t in p["targets"])
    rules = (DEPLOY / "prometheus" / "rules.yml").read_text()
    for needed in ("nv_trt_llm_kv_cache_block_metrics", "nv_trt_llm_request_metrics", "DCGM_FI_DEV_GPU_UTIL",
                   "DCGM_FI_DEV_FB_USED", "gateway_cost_total", "llm:ttft_seconds:p95", "llm:itl_seconds:p95",
                   "llm:output_tokens:rate1m", "llm:engine_waiting_requests"):
        assert needed in exprs, needed
    for rec in ("llm:ttft_seconds:p95", "llm:itl_seconds:p95", "llm:output_tokens:rate1m"):
        assert f"record: {rec}" in rules
    ds = yaml.safe_load((DEPLOY / "grafana" / "provisioning" / "datasources" / "prometheus.yml").read_text())
    uid = ds["datasources"][0]["uid"]
    assert all(p["datasource"]["uid"] == uid for p in d["panels"])


def test_gateway_metric_names_in_deploy_exist_in_the_gateway():
    from bls.gateway_metrics import FAMILIES

    text = (DEPLOY / "prometheus" / "rules.yml").read_text() + (DEPLOY / "grafana" / "dashboards" / "llm-serving.json").read_text()
    import re

    for name in set(re.findall(r"gateway_[a-z_]+", text)):
        base = re.sub(r"_(bucket|sum|count)$", "", name)
        assert base in FAMILIES, name


def test_kubernetes_manifests():
    docs = [d for d in yaml.safe_load_all((DEPLOY / "k8s" / "triton.yaml").read_text()) if d]
    kinds = {d["kind"]: d for d in docs}
    assert set(kinds) == {"Deployment", "Service", "HorizontalPodAutoscaler"}
    for d in docs:
        assert d["apiVersion"] and d["metadata"]["name"]
    pod = kinds["Deployment"]["spec"]["template"]["spec"]["containers"][0]
    assert pod["image"] == versions.TRITON_IMAGE
    assert pod["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert pod["readinessProbe"]["httpGet"]["path"] == "/v2/health/ready"
    assert pod["livenessProbe"]["httpGet"]["path"] == "/v2/health/live"
    sel = kinds["Deployment"]["spec"]["selector"]["matchLabels"]
    assert kinds["Deployment"]["spec"]["template"]["metadata"]["labels"] == sel == kinds["Service"]["spec"]["selector"]
    hpa = kinds["HorizontalPodAutoscaler"]["spec"]
    assert hpa["scaleTargetRef"]["name"] == kinds["Deployment"]["metadata"]["name"]
    metric = hpa["metrics"][0]["pods"]["metric"]["name"]
    adapter = yaml.safe_load((DEPLOY / "k8s" / "prometheus-adapter-values.yaml").read_text())
    assert adapter["rules"]["custom"][0]["name"]["as"] == metric
