"""deploy/: compose, Kubernetes manifests, Prometheus config and rules (promtool), Grafana provisioning and
dashboard, the load balancer. Validated structurally (no Docker engine or cluster here), with promtool,
and with a real nginx for the load balancer's hashing.

What must hold on every deploy target: only authenticated doors face clients (the front's port is the
only one published or in the client Service; Triton's HTTP/gRPC on loopback, its metrics internal, its
admin APIs behind a key), every path a rendered repository names exists in the container (the mount
map of build/deploy_targets.py), the HPA's metric has the labels its adapter rules need, and the shipped
load balancers come from the tests' template."""
import ast
import importlib.metadata
import json
import re
import shutil
import signal
import stat
import subprocess
import sys
import threading
import time
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import yaml

from build import deploy_targets, nginx_lb, render, trtllm, versions
from build.triton_flags import ADMIN_HEADER

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"


def compose():
    return yaml.safe_load((DEPLOY / "docker-compose.yml").read_text())


def k8s(name="triton.yaml"):
    return [d for d in yaml.safe_load_all((DEPLOY / "k8s" / name).read_text()) if d]


def kinds(docs, kind):
    return [d for d in docs if d["kind"] == kind]


def pair_command(service):
    """The compose replica's command: run-pair.sh, tritonserver's argv, `--`, the front's argv."""
    cmd = service["command"]
    assert cmd[:2] == ["bash", "/project/deploy/run-pair.sh"], cmd[:2]
    split = cmd.index("--")
    return cmd[2:split], cmd[split + 1:]


def rendered_paths(out: Path):
    """Every absolute path a rendered repository names (any parameter of any model)."""
    for cfg in out.glob("*/config.pbtxt"):
        for key, value in re.findall(r'key: "([^"]+)" value: \{ string_value: "([^"]*)" \}', cfg.read_text()):
            if value.startswith("/"):
                yield cfg.parent.name, key, value


@pytest.fixture
def ckpt(tmp_path):
    ck = tmp_path / "ckpt"
    ck.mkdir()
    (ck / "config.json").write_text(json.dumps({"max_position_embeddings": 8192}))
    return ck


# --- images and pins ---------------------------------------------------------------------------
def test_images_are_the_pinned_ones():
    s = compose()["services"]
    for name in ("llm", "llm-a", "llm-b"):
        assert s[name]["image"] == versions.PROJECT_IMAGE
        assert s[name]["build"]["args"]["TRITON_IMAGE"] == versions.TRITON_IMAGE
    assert s["dcgm-exporter"]["image"] == versions.DCGM_EXPORTER_IMAGE
    assert s["prometheus"]["image"] == versions.PROMETHEUS_IMAGE and s["grafana"]["image"] == versions.GRAFANA_IMAGE
    assert s["lb"]["image"] == versions.NGINX_IMAGE and s["redis"]["image"] == versions.REDIS_IMAGE
    dockerfile = (DEPLOY / "Dockerfile.trtllm").read_text()
    assert f"ARG TRITON_IMAGE={versions.TRITON_IMAGE}" in dockerfile and "FROM ${TRITON_IMAGE}" in dockerfile
    pod = kinds(k8s(), "Deployment")[0]["spec"]["template"]["spec"]["containers"]
    assert {c["image"] for c in pod} == {versions.PROJECT_IMAGE}
    images = {c["image"] for d in kinds(k8s("scale-out.yaml"), "Deployment")
              for c in d["spec"]["template"]["spec"]["containers"]}
    assert images == {versions.NGINX_IMAGE}
    redis = next(d for d in kinds(k8s(), "Deployment") if d["metadata"]["name"] == "llm-redis")
    assert {c["image"] for c in redis["spec"]["template"]["spec"]["containers"]} == {versions.REDIS_IMAGE}


def _imports(py: Path) -> list[str]:
    return [name for node in ast.walk(ast.parse(py.read_text()))
            for name in ([a.name for a in node.names] if isinstance(node, ast.Import) else
                         [node.module] if isinstance(node, ast.ImportFrom) and node.module and not node.level else [])]


def _third_party(names) -> set[str]:
    local = {p.name for p in ROOT.iterdir() if p.is_dir()}
    return {top for top in (name.split(".")[0] for name in names)
            if top not in sys.stdlib_module_names and top not in local and top != "triton_python_backend_utils"}


def _reached_imports(starts) -> set[str]:
    """The third-party modules the files `starts` import, with every project module they reach."""
    seen, names = set(), []
    todo = list(starts)
    while todo:
        py = todo.pop()
        if py in seen:
            continue
        seen.add(py)
        for name in _imports(py):
            names.append(name)
            parts = name.split(".")
            for n in range(len(parts), 0, -1):  # a module, a package, or a name imported from one
                candidates = (ROOT.joinpath(*parts[:n]).with_suffix(".py"), ROOT.joinpath(*parts[:n], "__init__.py"))
                found = next((c for c in candidates if c.is_file()), None)
                if found is not None:
                    todo.append(found)
                    break
    return _third_party(names)


def _model_imports() -> set[str]:
    """What the Python models of the GPU target import: their model.py files and every project module they
    reach (the `tensorrt_llm` model.py is the CPU engine's: on the GPU that model is the C++ backend)."""
    return _reached_imports(p for p in (ROOT / "model_repository").glob("*/1/model.py") if p.parts[-3] != "tensorrt_llm")


def _front_imports() -> set[str]:
    """What the front's virtualenv runs: the front, every project module it reaches (text/ for its own
    streams, ledger/ for the usage ledger), and the drain its preStop runs."""
    return _reached_imports([*(ROOT / "front").rglob("*.py"), ROOT / "launcher" / "drain.py"])


def test_the_model_import_walk_follows_project_modules():
    found = _model_imports()
    assert {"numpy", "yaml"} <= found  # numpy from the models, yaml from gateway/tenants.py
    assert "tritonclient" not in found  # contracts/grpc_inputs.py: the clients' module, no model reaches it
    front = _front_imports()
    assert {"tokenizers", "jinja2", "psycopg"} <= front  # text/ (its own streams), ledger/store.py (PostgreSQL)


def _pins(name: str, folder: Path = DEPLOY) -> dict[str, str]:
    """{package: pin} of a requirements file ("" where it has none)."""
    out = {}
    for line in (folder / name).read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            package, _, pin = line.partition("==")
            out[re.split(r"[\[<>]", package)[0].strip().lower().replace("_", "-")] = pin.strip()
    return out


def test_the_images_packages_are_pinned_as_the_cpu_default_pins_them():
    """What the GPU image installs for the models and the front is what the CPU default runs and tests: the
    pins of requirements.txt, or what they resolved to in the project's virtualenv."""
    default = _pins("requirements.txt", ROOT)
    for name in ("requirements-models.txt", "requirements-front.txt"):
        for package, pin in _pins(name).items():
            runs = default.get(package) or importlib.metadata.version(package)
            assert pin == runs, f"deploy/{name}: {package}=={pin}, the CPU default runs {runs}"


def test_the_image_builds_the_fronts_token_lane_for_the_fronts_python():
    """The mounted project is read-only: the image compiles front/token_lane.c into the front's virtualenv
    (tests/front/test_token_lane.py runs the same command on a copy and holds that the front finds it)."""
    dockerfile = (DEPLOY / "Dockerfile.trtllm").read_text()
    assert "COPY front/token_lane.c build/token_lane.py /tmp/lane/" in dockerfile
    run = re.search(r"RUN (/opt/front/bin/python /tmp/lane/token_lane\.py .*?rm -rf /tmp/lane)", dockerfile, re.S).group(1)
    assert "--require --source /tmp/lane/token_lane.c" in run and "--out-dir" in run and "platlib" in run
    assert re.search(r"apt-get install [^\n]*\bgcc\b[^\n]*", dockerfile) and "python3-dev" in dockerfile


def test_the_image_holds_what_the_python_code_imports():
    dockerfile = (DEPLOY / "Dockerfile.trtllm").read_text()
    checked = set(re.search(r'RUN python3 -c "import ([^"]+)"', dockerfile).group(1).replace(" ", "").split(","))
    # the Python models run in the image's own python3: the build fails if one of their packages is missing
    assert _model_imports() <= checked, _model_imports() - checked
    # and what they import beyond the image's own packages is installed into its python3
    assert "requirements-models.txt" in dockerfile and _pins("requirements-models.txt").keys() <= checked
    # the front runs in /opt/front, installed from deploy/requirements-front.txt, and the build imports all of
    # what it reaches there (a module missing would otherwise fail the pod at start, or its first request)
    listed = set(_pins("requirements-front.txt"))
    dists = importlib.metadata.packages_distributions()
    for module in sorted(_front_imports()):
        names = {d.lower().replace("_", "-") for d in dists.get(module, [module])}
        assert names & listed, f"the front reaches {module}: add its package to deploy/requirements-front.txt"
    front_checked = re.search(r'RUN /opt/front/bin/python -c "import ([^"]+)"', dockerfile).group(1)
    assert _front_imports() <= set(front_checked.replace(" ", "").split(",")), front_checked


# --- only authenticated doors face clients ------------------------------------------------------
def _published(service):
    for port in service.get("ports", []):
        parts = str(port).split(":")
        yield (parts[0] if len(parts) == 3 else "0.0.0.0"), int(parts[-1])


def test_compose_publishes_only_the_front_to_clients():
    s = compose()["services"]
    public = {(name, port) for name, svc in s.items() for host, port in _published(svc) if host != "127.0.0.1"}
    assert public == {("llm", 9000), ("lb", 9000)}  # the front (single) or the load balancer to fronts (scale)
    for name in ("llm", "llm-a", "llm-b"):
        triton, front = pair_command(s[name])
        key = "${TRITON_ADMIN_KEY:?set TRITON_ADMIN_KEY}"
        assert triton == trtllm.tritonserver_args("/repo", admin_key=key)  # one definition with `serve`
        assert "--http-address=127.0.0.1" in triton and "--grpc-address=127.0.0.1" in triton
        assert any(a.startswith("--http-restricted-api=") and "model-repository" in a and "logging" in a
                   and a.endswith(f"{ADMIN_HEADER}={key}") for a in triton)
        assert any(a.startswith("--grpc-restricted-protocol=") for a in triton)
        assert front == ["/opt/front/bin/python", "-m", "front", *trtllm.container_front_args("compose")]
        published = json.dumps(s[name].get("ports", []))
        assert "8002" not in published and "9002" not in published  # metrics: compose network only
        assert s[name]["expose"] == ["8002", "9002"]  # Triton's and the front's own, for Prometheus
    scrape = yaml.safe_load((DEPLOY / "prometheus" / "prometheus.yml").read_text())["scrape_configs"]
    for job, port in (("triton", 8002), ("front", 9002)):
        sd = next(j for j in scrape if j["job_name"] == job)["dns_sd_configs"][0]
        assert sd["port"] == port and set(sd["names"]) == {"llm", "llm-a", "llm-b"}
    assert (DEPLOY / ".env").read_text().count("COMPOSE_PROFILES=single") == 1
    assert {tuple(s[n]["profiles"]) for n in ("llm", "llm-a", "llm-b", "lb", "redis")} == {("single",), ("scale",)}


def _pod():
    deployment = kinds(k8s(), "Deployment")[0]
    spec = deployment["spec"]["template"]
    return deployment, spec, {c["name"]: c for c in spec["spec"]["containers"]}


def test_kubernetes_exposes_only_the_front_and_keeps_triton_on_loopback():
    deployment, spec, containers = _pod()
    triton, front = containers["triton"], containers["front"]
    assert triton["args"] == trtllm.tritonserver_args("/llm/model_repository", admin_key="$(TRITON_ADMIN_KEY)")
    assert {e["name"]: e for e in triton["env"]}["TRITON_ADMIN_KEY"]["valueFrom"]["secretKeyRef"]["name"]
    assert front["args"] == ["/opt/front/bin/python", "-m", "front", *trtllm.container_front_args("k8s")]
    front_port = {p["name"]: p["containerPort"] for p in front["ports"]}
    assert front_port == {"http": 9000, "front-metrics": 9002}  # no Service names 9002 (below)
    assert [p["containerPort"] for p in triton["ports"]] == [8002]
    assert triton["resources"]["limits"]["nvidia.com/gpu"] == 1 and "nvidia.com/gpu" not in front["resources"]["limits"]
    assert spec["metadata"]["labels"] == deployment["spec"]["selector"]["matchLabels"]
    # Triton is on loopback: the kubelet cannot reach it, so its probes run inside the container
    for probe, path in (("readinessProbe", "/v2/health/ready"), ("livenessProbe", "/v2/health/live"),
                        ("startupProbe", "/v2/health/ready")):
        assert triton[probe]["exec"]["command"] == ["curl", "-sf", f"http://127.0.0.1:8000{path}"]
    services = {s["metadata"]["name"]: s for s in kinds(k8s(), "Service") if s["metadata"]["labels"]["app"] == "triton-llm"}
    assert set(services) == {"triton-llm", "triton-llm-pods"}
    for svc in services.values():
        assert [p["targetPort"] for p in svc["spec"]["ports"]] == ["http"]  # the front's port, nothing else
        assert [p["port"] for p in svc["spec"]["ports"]] == [9000]
        assert svc["spec"]["selector"] == deployment["spec"]["selector"]["matchLabels"]
    assert services["triton-llm-pods"]["spec"]["clusterIP"] == "None"
    policy = kinds(k8s(), "NetworkPolicy")[0]
    rules = {r["ports"][0]["port"]: r for r in policy["spec"]["ingress"]}
    assert set(rules) == {9000, 8002} and "from" not in rules[9000]
    assert rules[8002]["from"][0]["podSelector"]["matchLabels"] == {"app.kubernetes.io/name": "prometheus"}
    assert {p["port"] for p in rules[8002]["ports"]} == {8002, 9002}  # Triton's metrics and the front's own
    assert spec["metadata"]["annotations"]["prometheus.io/port"] == "8002"


def _sigterm_marker(path):
    """A process that writes `path` when SIGTERM reaches it, then exits."""
    code = ("import signal, sys, time\n"
            f"signal.signal(signal.SIGTERM, lambda *a: (open({str(path)!r}, 'w').write('TERM'), sys.exit(0)))\n"
            "time.sleep(30)\n")
    return [sys.executable, "-c", code]


def test_run_pair_stops_both_processes(tmp_path):
    script = str(DEPLOY / "run-pair.sh")
    assert subprocess.run(["bash", script, "sleep", "1"], capture_output=True).returncode == 2  # no `--`
    t0 = time.monotonic()
    server = tmp_path / "server-got-term"
    done = subprocess.run(["bash", script, *_sigterm_marker(server), "--", "bash", "-c", "sleep 0.5; exit 3"],
                          timeout=20)
    assert done.returncode == 3 and time.monotonic() - t0 < 10  # the front died: its exit code, and
    assert server.read_text() == "TERM"  # the server was told to stop
    front = tmp_path / "front-got-term"
    server.unlink()
    proc = subprocess.Popen(["bash", script, *_sigterm_marker(server), "--", *_sigterm_marker(front)],
                            start_new_session=True)
    time.sleep(1.0)
    proc.send_signal(signal.SIGTERM)  # `docker stop`
    proc.wait(timeout=10)
    assert server.read_text() == "TERM" and front.read_text() == "TERM"
    left = subprocess.run(["pgrep", "-g", str(proc.pid)], capture_output=True, text=True).stdout.split()
    assert left == [], left  # nothing outlives the container's main process


def test_run_pair_gives_both_processes_one_front_key_drawn_at_each_start(tmp_path):
    """The gateway admits the front's leases with the key the front holds: one key for both, unknown to
    anyone else, new at each start unless the environment sets one."""
    script = str(DEPLOY / "run-pair.sh")

    def keys(env, name="LLM_FRONT_KEY"):
        out = tmp_path / "keys"
        out.write_text("")
        cmd = ["bash", script, "bash", "-c", f"echo triton=${name} >> {out}; sleep 1", "--",
               "bash", "-c", f"echo front=${name} >> {out}; sleep 0.2"]
        subprocess.run(cmd, env={"PATH": "/usr/bin:/bin", "TMPDIR": str(tmp_path), **env}, timeout=20)
        return dict(line.split("=", 1) for line in out.read_text().split())

    first, second = keys({}), keys({"LLM_FRONT_KEY": ""})
    assert first["triton"] == first["front"] and len(first["front"]) >= 32, first
    assert second["triton"] == second["front"] != first["front"]  # drawn again: no key outlives its container
    assert keys({"LLM_FRONT_KEY": "set-by-the-operator"}) == {"triton": "set-by-the-operator",
                                                               "front": "set-by-the-operator"}
    # and one lease socket (docs/gateway.md) in a folder of this start's own, unless set (empty: none)
    socket = keys({}, "LLM_GATEWAY_SOCKET")
    folder = Path(socket["front"]).parent
    assert socket["triton"] == socket["front"] and folder.parent == tmp_path and folder.name.startswith("llm-lease-")
    assert folder.is_dir() and stat.S_IMODE(folder.stat().st_mode) == 0o700
    assert keys({"LLM_GATEWAY_SOCKET": ""}, "LLM_GATEWAY_SOCKET") == {"triton": "", "front": ""}
    # no folder to make one in: none, said on stderr (the operations go through Triton), never "/gateway.sock"
    out = tmp_path / "keys"
    out.write_text("")
    done = subprocess.run(["bash", script, "bash", "-c", f"echo triton=$LLM_GATEWAY_SOCKET >> {out}; sleep 1", "--",
                           "bash", "-c", f"echo front=$LLM_GATEWAY_SOCKET >> {out}; sleep 0.2"],
                          env={"PATH": "/usr/bin:/bin", "TMPDIR": str(tmp_path / "absent")}, timeout=20,
                          capture_output=True, text=True)
    assert dict(line.split("=", 1) for line in out.read_text().split()) == {"triton": "", "front": ""}
    assert "lease operations go through Triton" in done.stderr


def _front_tokenizer(args: list[str]) -> str:
    assert args[args.index("--workers") + 1] == str(trtllm.GPU_FRONT_WORKERS)
    return args[args.index("--tokenizer-dir") + 1]


@pytest.mark.parametrize("target", ["docker", "compose", "k8s"])
def test_every_gpu_target_runs_the_fronts_own_streams(tmp_path, ckpt, target):
    """Issue 28: without --tokenizer-dir and LLM_FRONT_KEY every token crosses the gateway's one Python
    process (about 1,100-1,500 tok/s on 16 cores). On each GPU target the front streams from the engine with
    the tokenizer the rendered repository names (the same checkpoint, as the front's container sees it),
    in several processes, and the gateway and the front hold one LLM_FRONT_KEY."""
    t = deploy_targets.get(target)
    repo = render.render("trtllm", tmp_path / "repo", checkpoint=ckpt, deploy=target)
    rendered = {v for model, key, v in rendered_paths(repo) if key == "tokenizer_dir"}
    assert rendered == {t.paths["tokenizer_dir"]}
    if target == "docker":  # `build/trtllm.py serve`: the front beside the container, on this machine
        front = trtllm.front_command("127.0.0.1", 9000, 8001, tmp_path / "data", 8000, ckpt)
        mounts = trtllm.serve_mounts(tmp_path / "engine", tmp_path / "repo", ckpt)
        assert mounts[ckpt] == t.paths["tokenizer_dir"] and _front_tokenizer(front) == str(ckpt)
        cmd = trtllm.serve_command(tmp_path / "engine", tmp_path / "repo", ckpt, 1)
        envs = [cmd[i + 1] for i, a in enumerate(cmd) if a == "-e"]
        assert "LLM_FRONT_KEY" in envs  # by name: the front's own environment's, never on a command line
    elif target == "compose":  # one container: run-pair.sh gives both processes the key it draws
        for name in ("llm", "llm-a", "llm-b"):
            _, front = pair_command(compose()["services"][name])
            assert _front_tokenizer(front) == t.paths["tokenizer_dir"]
            assert "LLM_FRONT_KEY" not in compose()["services"][name]["environment"]
    else:  # two containers in one pod: the key from one Secret in both, the tokenizer on the front's mounts
        _, _, containers = _pod()
        front = containers["front"]
        tokenizer = _front_tokenizer(front["args"])
        assert tokenizer == t.paths["tokenizer_dir"]
        assert any(tokenizer.startswith(m["mountPath"] + "/") for m in front["volumeMounts"])
        refs = [{e["name"]: e for e in c["env"]}["LLM_FRONT_KEY"]["valueFrom"]["secretKeyRef"]
                for c in (containers["triton"], front)]
        assert refs[0] == refs[1] and not refs[0].get("optional")
        # the lease socket: one path, in a volume of the pod's own that both containers mount
        for c in (containers["triton"], front):
            assert {e["name"]: e for e in c["env"]}["LLM_GATEWAY_SOCKET"]["value"] == \
                f"{deploy_targets.LEASE_SOCKET_DIR}/gateway.sock"
            mount = next(m for m in c["volumeMounts"] if m["mountPath"] == deploy_targets.LEASE_SOCKET_DIR)
            assert not mount.get("readOnly")
        volume = {v["name"]: v for v in _pod()[1]["spec"]["volumes"]}[mount["name"]]
        assert "emptyDir" in volume
        assert f"kubectl create secret generic {refs[0]['name']} --from-literal={refs[0]['key']}=" in \
            (DEPLOY / "k8s" / "triton.yaml").read_text()


# --- finding 4: every rendered path exists in the container --------------------------------------
def _container_paths(volumes):
    return {v.split(":")[-2] if v.endswith((":ro", ":rw")) else v.split(":")[-1] for v in volumes}


@pytest.mark.parametrize("target", ["docker", "compose", "k8s"])
def test_rendered_paths_exist_in_the_container(tmp_path, ckpt, target):
    t = deploy_targets.get(target)
    if target == "docker":
        mounts = set(trtllm.serve_mounts(tmp_path / "engine", tmp_path / "repo", ckpt).values())
        inner = trtllm.serve_command(tmp_path, tmp_path, ckpt, 1)[-1]
        repo = re.search(r"--model-repository=(\S+)", inner).group(1)
        pythonpath = next(e for e in trtllm.serve_command(tmp_path, tmp_path, ckpt, 1)
                          if e.startswith("PYTHONPATH=")).split("=", 1)[1]
    elif target == "compose":
        services = compose()["services"]
        mounts = _container_paths(services["llm"]["volumes"])
        for name in ("llm-a", "llm-b"):
            assert _container_paths(services[name]["volumes"]) == mounts
        triton, _ = pair_command(services["llm"])
        repo = next(a.split("=", 1)[1] for a in triton if a.startswith("--model-repository="))
        pythonpath = services["llm"]["environment"]["PYTHONPATH"]
        assert services["llm"]["working_dir"] == pythonpath
    else:
        _, spec, containers = _pod()
        mounts = {m["mountPath"] for m in containers["triton"]["volumeMounts"]} - {"/dev/shm"}
        repo = next(a.split("=", 1)[1] for a in containers["triton"]["args"] if a.startswith("--model-repository="))
        pythonpath = {e["name"]: e.get("value") for e in containers["triton"]["env"]}["PYTHONPATH"]
        assert {e["name"]: e.get("value") for e in containers["front"]["env"]}["PYTHONPATH"] == pythonpath
    assert mounts == set(t.mounts), "the deploy file and build/deploy_targets.py disagree"
    assert repo == t.model_repository and t.covers(repo) and t.covers(pythonpath)
    out = render.render("trtllm", tmp_path / "repo", checkpoint=ckpt, deploy=target)
    found = list(rendered_paths(out))
    assert {k for _, k, _ in found} >= {"tokenizer_dir", "gateway_config", "gpt_model_path", "executor_worker_path"}
    for model, key, value in found:
        assert t.covers(value), f"{model}.{key} = {value} is not inside any mount of {target}"
    # and the host's own paths never leak into a container's repository
    assert str(ROOT) not in "".join(v for _, _, v in found) and str(ckpt) not in "".join(v for _, _, v in found)


# --- finding 5: the HPA's metric has the labels the adapter rules need ----------------------------
def test_hpa_metric_gets_namespace_and_pod_labels_from_the_shipped_scrape_config():
    adapters = yaml.safe_load((DEPLOY / "k8s" / "prometheus-adapter-values.yaml").read_text())["rules"]["custom"]
    hpa = kinds(k8s(), "HorizontalPodAutoscaler")[0]["spec"]
    # every metric the HPA reads is one the adapter serves: queue depth and DCGM's GPU utilization
    assert [m["pods"]["metric"]["name"] for m in hpa["metrics"]] == [a["name"]["as"] for a in adapters] \
        == ["llm_queue_depth", "llm_gpu_utilization"]
    for adapter in adapters:
        needed = set(adapter["resources"]["overrides"])
        assert needed == {"namespace", "pod"} and all(f'{label}!=""' in adapter["seriesQuery"] for label in needed)
    # stabilized both ways, one pod at a time (a new pod loads an engine for minutes)
    assert hpa["behavior"]["scaleUp"]["stabilizationWindowSeconds"] > 0
    assert hpa["behavior"]["scaleDown"]["stabilizationWindowSeconds"] >= 300
    assert all(p == {"type": "Pods", "value": 1, "periodSeconds": p["periodSeconds"]}
               for way in ("scaleUp", "scaleDown") for p in hpa["behavior"][way]["policies"])
    cm = kinds(k8s("prometheus-scrape.yaml"), "ConfigMap")[0]
    job = yaml.safe_load(cm["data"]["prometheus.yml"])["scrape_configs"][0]
    assert job["kubernetes_sd_configs"] == [{"role": "pod"}]
    targets = {r["target_label"]: r["source_labels"] for r in job["relabel_configs"] if "target_label" in r}
    assert targets["namespace"] == ["__meta_kubernetes_namespace"]
    assert targets["pod"] == ["__meta_kubernetes_pod_name"]
    assert targets["__address__"][1] == "__meta_kubernetes_pod_annotation_prometheus_io_port"
    keep = next(r for r in job["relabel_configs"] if r.get("action") == "keep")
    assert keep["source_labels"] == ["__meta_kubernetes_pod_annotation_prometheus_io_scrape"]
    _, spec, containers = _pod()
    assert spec["metadata"]["annotations"]["prometheus.io/scrape"] == "true"
    # the operator's alternative selects the same pods and the port that serves the metrics
    podmonitor = kinds(k8s("podmonitor.yaml"), "PodMonitor")[0]["spec"]
    assert podmonitor["selector"]["matchLabels"] == spec["metadata"]["labels"]
    assert [e["port"] for e in podmonitor["podMetricsEndpoints"]] == \
        [containers["triton"]["ports"][0]["name"], "front-metrics"]
    # the front's own metrics: a second job, by the container port's name
    front_job = yaml.safe_load(cm["data"]["prometheus.yml"])["scrape_configs"][1]
    keep = next(r for r in front_job["relabel_configs"] if r.get("action") == "keep")
    assert keep["source_labels"] == ["__meta_kubernetes_pod_label_app", "__meta_kubernetes_pod_container_port_name"]
    assert keep["regex"] == f"{spec['metadata']['labels']['app']};front-metrics"
    assert "front-metrics" in {p["name"] for p in containers["front"]["ports"]}


# --- finding 9: load balancer and Redis from one template -----------------------------------------
def test_shipped_load_balancers_come_from_the_tests_template():
    for path, text in nginx_lb.shipped().items():
        assert path.read_text() == text, f"{path.name} is stale: python build/nginx_lb.py --write"
    compose_conf = nginx_lb.COMPOSE_CONF.read_text()
    assert f"hash {nginx_lb.HASH_KEY} consistent;" in compose_conf
    assert "$http_authorization" in nginx_lb.HASH_KEY and "$http_x_api_key" in nginx_lb.HASH_KEY
    s = compose()["services"]
    assert re.findall(r"server (\S+) resolve;", compose_conf) == [f"{n}:9000" for n in ("llm-a", "llm-b")]
    assert "./nginx/llm-lb.compose.conf:/etc/nginx/nginx.conf:ro" in s["lb"]["volumes"]
    assert set(s["lb"]["depends_on"]) == {"llm-a", "llm-b"} and "redis" in s["llm-a"]["depends_on"]
    assert re.findall(r"server (\S+) resolve;", nginx_lb.K8S_CONF.read_text()) == \
        ["triton-llm-pods.default.svc.cluster.local:9000"]
    lb = next(d for d in kinds(k8s("scale-out.yaml"), "Deployment") if d["metadata"]["name"] == "llm-lb")
    assert lb["spec"]["template"]["spec"]["volumes"][0]["configMap"]["name"] == "llm-lb"
    assert "llm-lb.k8s.conf" in (DEPLOY / "k8s" / "scale-out.yaml").read_text()
    assert {s["metadata"]["name"] for s in kinds(k8s("scale-out.yaml"), "Service")} == {"llm-lb"}
    # the tests' multi-replica nginx renders the same template
    assert "render_lb_config(" in (ROOT / "tests" / "support" / "nginx.py").read_text()


class _Replica(ThreadingHTTPServer):
    daemon_threads = True


def _replica(name):
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200)
            self.end_headers()
            self.wfile.write(name.encode())

        do_POST = do_GET

        def log_message(self, *args):
            pass

    server = _Replica(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def test_load_balancer_keeps_each_api_key_on_one_replica():
    from tests.support.nginx import Nginx

    replicas = [_replica("a"), _replica("b")]
    try:
        with Nginx([f"127.0.0.1:{r.server_address[1]}" for r in replicas], balance="hash") as lb:
            def hit(headers):
                req = urllib.request.Request(f"http://{lb.url}/v1/chat/completions", data=b"{}", headers=headers)
                return urllib.request.urlopen(req, timeout=5).read().decode()

            placed = {}
            for i in range(24):
                for header in ("Authorization", "x-api-key"):
                    value = f"Bearer sk-tenant-{i}" if header == "Authorization" else f"sk-tenant-{i}"
                    seen = {hit({header: value}) for _ in range(4)}
                    assert len(seen) == 1, (header, i, seen)  # one tenant, one replica
                    placed[(header, i)] = seen.pop()
            assert set(placed.values()) == {"a", "b"}  # and the tenants spread over both
    finally:
        for r in replicas:
            r.shutdown()


# --- monitoring --------------------------------------------------------------------------------
@pytest.mark.skipif(not shutil.which("promtool"), reason="promtool not installed (build/system_deps.sh installs it)")
def test_rules_and_compose_config_pass_promtool(tmp_path):
    out = subprocess.run(["promtool", "check", "rules", str(DEPLOY / "prometheus" / "rules.yml")],
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr
    cfg = tmp_path / "prometheus.yml"
    cfg.write_text((DEPLOY / "prometheus" / "prometheus.yml").read_text()
                   .replace("/etc/prometheus/rules.yml", str(DEPLOY / "prometheus" / "rules.yml")))
    out = subprocess.run(["promtool", "check", "config", str(cfg)], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr


def test_compose_monitoring_mounts_exist_and_gpus_are_reserved():
    s = compose()["services"]
    for vol in s["prometheus"]["volumes"] + s["grafana"]["volumes"] + s["lb"]["volumes"]:
        assert (DEPLOY / vol.split(":")[0]).exists(), vol
    for name in ("llm", "llm-a", "llm-b", "dcgm-exporter"):
        assert s[name]["deploy"]["resources"]["reservations"]["devices"][0]["capabilities"] == ["gpu"]
    assert [s[n]["deploy"]["resources"]["reservations"]["devices"][0]["device_ids"] for n in ("llm-a", "llm-b")] \
        == [["0"], ["1"]]  # one GPU per replica


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
    from gateway.metrics import FAMILIES

    text = (DEPLOY / "prometheus" / "rules.yml").read_text() + (DEPLOY / "grafana" / "dashboards" / "llm-serving.json").read_text()
    for name in set(re.findall(r"gateway_[a-z_]+", text)):
        base = re.sub(r"_(bucket|sum|count)$", "", name)
        assert base in FAMILIES, name


# --- the usage ledger runs on every GPU target (issue 20: the GPU serve had none) -------------------
def test_every_gpu_target_gives_the_gateway_and_the_front_one_writable_ledger_folder(tmp_path, ckpt):
    data = deploy_targets.DATA_DIR
    # docker (`build/trtllm.py serve`): the host folder at /data, the front beside it on the same folder
    cmd = trtllm.serve_command(tmp_path / "engine", tmp_path / "repo", ckpt, 1, data_dir=tmp_path / "data")
    assert f"{(tmp_path / 'data').resolve()}:{data}" in cmd  # a bind mount, not read-only
    envs = [cmd[i + 1] for i, a in enumerate(cmd) if a == "-e"]
    assert f"LLM_DATA_DIR={data}" in envs
    assert "LLM_BATCH_WORKER_KEY" in envs  # by name only: the key's value never appears in a command
    front = trtllm.front_command("127.0.0.1", 9000, 8001, tmp_path / "data")
    assert front[front.index("--data-dir") + 1] == str(tmp_path / "data")
    # compose: the one container runs both; each replica has a volume of its own at /data, writable
    services = compose()["services"]
    volumes = {name: [v for v in services[name]["volumes"] if v.split(":")[1] == data] for name in ("llm", "llm-a", "llm-b")}
    assert all(len(v) == 1 and not v[0].endswith(":ro") for v in volumes.values()), volumes
    assert len({v[0].split(":")[0] for v in volumes.values()}) == 3
    assert services["llm"]["environment"]["LLM_DATA_DIR"] == data
    assert set(compose()["volumes"]) >= {v[0].split(":")[0] for v in volumes.values()}
    # k8s: both containers mount the pod's data volume and name it in LLM_DATA_DIR
    _, spec, containers = _pod()
    for name in ("triton", "front"):
        c = containers[name]
        mount = [m for m in c["volumeMounts"] if m["mountPath"] == data]
        assert len(mount) == 1 and not mount[0].get("readOnly"), name
        env = {e["name"]: e for e in c["env"]}
        assert env["LLM_DATA_DIR"]["value"] == data, name
        assert env["LLM_BATCH_WORKER_KEY"]["valueFrom"]["secretKeyRef"]["optional"] is True
    volume = {v["name"]: v for v in spec["spec"]["volumes"]}[mount[0]["name"]]
    assert "emptyDir" in volume or "persistentVolumeClaim" in volume


# --- issue 31: schema, availability, drain ---------------------------------------------------------
K8S_VERSION = "1.31.0"  # the schemas kubernetes-validate ships for this Kubernetes (requirements.txt)
CRDS = {("monitoring.coreos.com/v1", "PodMonitor"), ("monitoring.coreos.com/v1", "PrometheusRule")}


def test_every_kubernetes_manifest_passes_the_schema():
    """Every object against Kubernetes' own OpenAPI schema (strict: an unknown or misspelt field fails);
    the Prometheus operator's objects, which that schema does not have, structurally."""
    import kubernetes_validate

    seen = set()
    for path in sorted((DEPLOY / "k8s").glob("*.yaml")):
        if path.name == "prometheus-adapter-values.yaml":  # Helm values, not an object
            continue
        for doc in k8s(path.name):
            seen.add(doc["kind"])
            if (doc["apiVersion"], doc["kind"]) in CRDS:
                assert doc["metadata"]["name"] and isinstance(doc["spec"], dict), path.name
                continue
            kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
    assert {"Deployment", "Service", "NetworkPolicy", "PodDisruptionBudget", "HorizontalPodAutoscaler",
            "ConfigMap", "PodMonitor", "PrometheusRule"} <= seen
    broken = kinds(k8s(), "Deployment")[0]
    broken["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]["periodSecond"] = 5
    with pytest.raises(Exception, match="periodSecond"):  # the validator does catch a typo
        kubernetes_validate.validate(broken, K8S_VERSION, strict=True)


def test_kubernetes_availability_fits_one_gpu_per_pod():
    deployment, spec, containers = _pod()
    gpus = [c["resources"]["limits"].get("nvidia.com/gpu", 0) for c in containers.values()]
    assert sum(gpus) == 1
    rolling = deployment["spec"]["strategy"]["rollingUpdate"]
    assert rolling == {"maxSurge": 0, "maxUnavailable": 1}  # a surge pod would wait for a GPU no node has
    pdb = kinds(k8s(), "PodDisruptionBudget")[0]["spec"]
    assert pdb["selector"]["matchLabels"] == deployment["spec"]["selector"]["matchLabels"]
    assert pdb == {"maxUnavailable": 1, "selector": pdb["selector"]}  # minAvailable would block a 1-pod drain
    spread = spec["spec"]["topologySpreadConstraints"]
    assert {c["topologyKey"] for c in spread} == {"kubernetes.io/hostname", "topology.kubernetes.io/zone"}
    assert all(c["labelSelector"]["matchLabels"] == deployment["spec"]["selector"]["matchLabels"] for c in spread)


def _drain_args(container):
    from launcher import drain

    cmd = container["lifecycle"]["preStop"]["exec"]["command"]
    i = cmd.index("launcher.drain")
    assert cmd[i - 1] == "-m"
    parser_args = cmd[i + 1:]
    captured = {}
    real = drain.drain_front, drain.wait_drained
    try:
        drain.drain_front = lambda d, url, grace, timeout, spool_dir=None: captured.update(
            dir=d, url=url, grace=grace, timeout=timeout, spool=spool_dir) or 0
        drain.wait_drained = lambda d, timeout: captured.update(dir=d, timeout=timeout) or True
        assert drain.main(parser_args) == 0
    finally:
        drain.drain_front, drain.wait_drained = real
    return parser_args[0], captured


def test_a_stopping_pod_drains_before_its_processes_stop():
    """preStop hooks: the front's readiness goes off and its requests finish before SIGTERM; tritonserver
    waits for that. The marker folder is the one the front reads, on the volume both containers share,
    and the grace period covers both waits."""
    _, spec, containers = _pod()
    front, triton = containers["front"], containers["triton"]
    kind, f = _drain_args(front)
    assert kind == "front" and f["url"] == "http://127.0.0.1:9002/metrics"  # the front's default metrics port
    kind, t = _drain_args(triton)
    assert kind == "triton" and str(t["dir"]) == str(f["dir"])
    env = {e["name"]: e.get("value") for e in front["env"]}
    assert env["LLM_DRAIN_DIR"] == str(f["dir"])
    assert str(f["spool"]) == f"{env['LLM_DATA_DIR']}/spool"  # the gateway's spool (docs/usage.md), loaded before the pod goes
    data = deploy_targets.DATA_DIR
    assert str(f["dir"]).startswith(data + "/")
    for c in (front, triton):
        assert any(m["mountPath"] == data and not m.get("readOnly") for m in c["volumeMounts"])
    assert front["readinessProbe"]["httpGet"] == {"path": "/health/ready", "port": "http"}
    assert t["timeout"] >= f["grace"] + f["timeout"]  # Triton outwaits the front's drain
    assert spec["spec"]["terminationGracePeriodSeconds"] > t["timeout"] + 15  # and tritonserver's own exit
    # the front's /health/ready is the route the front serves (tests/launcher/test_drain.py: 503 while draining)
    assert "/health/ready" in (ROOT / "front" / "app.py").read_text()
