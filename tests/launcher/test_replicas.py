"""Several replicas (issue 31, item 5): what the Kubernetes manifests and `render --deploy k8s` give each pod
must be state every pod shares. Rate limits: the rendered gateway names triton.yaml's Redis, and rendering
refuses to leave it empty. Ledger and Batch API: the pods' fronts, configured as the manifest configures
them, keep files and batches in one PostgreSQL (a real one here), so a batch created through one pod is
found through another (with per-pod SQLite it was a 404)."""
import json
from pathlib import Path
from urllib.parse import urlparse

import pytest
import yaml

from build import deploy_targets, render
from front.ledger_api import LedgerService, LedgerSettings
from contracts.errors import ServingError
from tests.support.postgres import PostgresServer

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "deploy" / "k8s"


def docs(name="triton.yaml"):
    return [d for d in yaml.safe_load_all((K8S / name).read_text()) if d]


def pod_env():
    deployment = next(d for d in docs() if d["kind"] == "Deployment" and d["metadata"]["name"] == "triton-llm")
    return {c["name"]: {e["name"]: e for e in c.get("env", [])}
            for c in deployment["spec"]["template"]["spec"]["containers"]}


@pytest.fixture
def ckpt(tmp_path):
    ck = tmp_path / "ckpt"
    ck.mkdir()
    (ck / "config.json").write_text(json.dumps({"max_position_embeddings": 8192}))
    return ck


def test_kubernetes_renders_the_shared_rate_limit_store_and_refuses_none(tmp_path, ckpt):
    hpa = next(d for d in docs() if d["kind"] == "HorizontalPodAutoscaler")
    assert hpa["spec"]["maxReplicas"] > 1  # why the state must be shared
    out = render.render("trtllm", tmp_path / "repo", checkpoint=ckpt, deploy="k8s")
    gateway = (out / "gateway" / "config.pbtxt").read_text()
    url = deploy_targets.get("k8s").shared_state["gateway_redis_url"]
    assert f'key: "redis_url" value: {{ string_value: "{url}" }}' in gateway
    # the URL names the manifest's Redis Service and port
    host = urlparse(url)
    service = next(d for d in docs() if d["kind"] == "Service" and d["metadata"]["name"] == host.hostname)
    assert [p["port"] for p in service["spec"]["ports"]] == [host.port]
    redis = next(d for d in docs() if d["kind"] == "Deployment" and d["metadata"]["name"] == host.hostname)
    assert redis["spec"]["selector"]["matchLabels"] == service["spec"]["selector"]
    with pytest.raises(render.RenderError, match="gateway_redis_url cannot be empty"):
        render.render("trtllm", tmp_path / "r2", {"gateway_redis_url": ""}, checkpoint=ckpt, deploy="k8s")
    assert render.main(["--target", "trtllm", "--deploy", "k8s", "--out", str(tmp_path / "r3"), "--checkpoint",
                        str(ckpt), "--set", "gateway_redis_url="]) == 2
    # another Redis may be named; single-machine targets keep per-process limits by default
    other = render.render("trtllm", tmp_path / "r4", {"gateway_redis_url": "redis://r.example:6380/1"},
                          checkpoint=ckpt, deploy="k8s")
    assert "redis://r.example:6380/1" in (other / "gateway" / "config.pbtxt").read_text()
    single = render.render("trtllm", tmp_path / "r5", checkpoint=ckpt, deploy="compose")
    assert 'key: "redis_url" value: { string_value: "" }' in (single / "gateway" / "config.pbtxt").read_text()


def test_every_pod_must_have_the_shared_ledger():
    env = pod_env()
    for container in ("triton", "front"):
        ref = env[container]["LLM_LEDGER_URL"]["valueFrom"]["secretKeyRef"]
        assert ref["name"] == "llm-ledger" and not ref.get("optional", False), container  # no Secret: no pod


@pytest.fixture(scope="module")
def pg():
    with PostgresServer() as server:
        yield server


def _pod(tmp_path: Path, name: str, ledger_url: str | None) -> LedgerService:
    """A pod's front ledger service, set as the manifest sets it: its own data folder, the shared URL."""
    service = LedgerService(LedgerSettings(data_dir=tmp_path / name, ledger_url=ledger_url), lines=None,
                            metrics=None, collect=None)
    service.ensure_ready()
    return service


def test_a_batch_created_through_one_pod_is_found_through_another(tmp_path, pg):
    line = json.dumps({"custom_id": "a", "method": "POST", "url": "/v1/chat/completions",
                       "body": {"model": "auto", "messages": [{"role": "user", "content": "Hi"}]}})
    a, b = _pod(tmp_path, "pod-a", pg.url), _pod(tmp_path, "pod-b", pg.url)
    try:
        f = a.jobs.upload("acme", "batch", "in.jsonl", (line + "\n").encode())
        batch = a.jobs.create("acme", {"input_file_id": f["id"], "endpoint": "/v1/chat/completions"})
        assert b.jobs.get("acme", batch["id"])["id"] == batch["id"]
        assert b.jobs.file("acme", f["id"])["id"] == f["id"]
        with pytest.raises(ServingError) as e:  # still scoped to the tenant on every pod
            b.jobs.get("globex", batch["id"])
        assert e.value.kind == "not_found"
    finally:
        a.store.close()
        b.store.close()
    # what each pod had before: its own SQLite ledger, where the other pod's batch does not exist
    c, d = _pod(tmp_path, "pod-c", None), _pod(tmp_path, "pod-d", None)
    try:
        f = c.jobs.upload("acme", "batch", "in.jsonl", (line + "\n").encode())
        batch = c.jobs.create("acme", {"input_file_id": f["id"], "endpoint": "/v1/chat/completions"})
        with pytest.raises(ServingError) as e:
            d.jobs.get("acme", batch["id"])
        assert e.value.kind == "not_found"
    finally:
        c.store.close()
        d.store.close()
