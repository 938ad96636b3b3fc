"""The front as several worker processes on one port (front/__main__.py --workers): every worker serves,
limits stay exact because they live in the gateway, and the workers' metrics add up on one port."""
import concurrent.futures
import urllib.request

import openai
import psutil
import pytest

from benchmarks.triton_bench import bench_gateway_config
from clients.prometheus import metric_value
from tests.support.server import TritonServer

pytestmark = pytest.mark.integration
KEY = "sk-workers-test"
RPM = 6


@pytest.fixture(scope="module")
def stack(checkpoint, tmp_path_factory):
    # the limit two workers must share exactly
    path = bench_gateway_config(tmp_path_factory.mktemp("workers") / "gateway.yaml", KEY, requests_per_minute=RPM)
    with TritonServer(front=True, front_workers=2, overrides={"gateway_config": str(path)}) as s:
        yield s


def test_two_workers_serve_one_port_and_share_the_gateways_limits_exactly(stack):
    workers = [p for p in psutil.Process(stack.stack.front.pid).children() if "python" in p.name()]
    assert len(workers) >= 2

    def ask(i):
        sdk = openai.OpenAI(base_url=f"{stack.front_url}/v1", api_key=KEY, max_retries=0, timeout=120)
        try:
            return sdk.completions.create(model="auto", prompt=f"Say {i}.", max_tokens=2, temperature=0).choices[0].text
        except openai.RateLimitError:
            return None

    with concurrent.futures.ThreadPoolExecutor(10) as pool:
        answers = list(pool.map(ask, range(RPM + 4)))
    assert sum(a is not None for a in answers) == RPM  # the workers share one bucket: the gateway's
    with urllib.request.urlopen(f"http://127.0.0.1:{stack.front_metrics_port}/metrics", timeout=5) as r:
        text = r.read().decode()
    served = metric_value(text, "llm_front_requests_total", route="/v1/completions", status="200")
    limited = metric_value(text, "llm_front_requests_total", route="/v1/completions", status="429")
    assert served == RPM and limited == 4  # every worker's counts, summed on the one metrics port
