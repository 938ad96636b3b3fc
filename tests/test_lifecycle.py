"""The stack's lifecycle against real processes: a killed engine stub comes back by itself, and SIGTERM
drains in-flight streams and leaves no process behind. (A client that leaves the front stops the engine:
tests/front/test_front_server.py.)"""
import threading
import time

import openai
import psutil
import pytest

from launcher.stack import python_stubs
from tests.support.server import TritonServer

pytestmark = pytest.mark.integration
KEY = "sk-demo-acme-enterprise"
PROMPT = "The capital of France is"


def sdk(server):
    return openai.OpenAI(base_url=f"{server.front_url}/v1", api_key=KEY, max_retries=0, timeout=120)


def test_a_killed_engine_stub_is_reloaded_and_serves_again():
    with TritonServer(front=True) as server:
        stub = python_stubs(server.proc.pid)["tensorrt_llm"]
        psutil.Process(stub).kill()
        killed = time.monotonic()
        answer = None
        while time.monotonic() - killed < 60:
            try:
                answer = sdk(server).completions.create(model="auto", prompt=PROMPT, max_tokens=4, temperature=0)
                break
            except openai.APIError:
                time.sleep(1)
        assert answer is not None and "Paris" in answer.choices[0].text, server.log_tail()
        assert server.stack.reloads == ["tensorrt_llm"]
        assert python_stubs(server.proc.pid)["tensorrt_llm"] != stub


def test_sigterm_drains_streams_then_leaves_no_process():
    server = TritonServer(front=True, drain_timeout_s=30).start()
    tree = psutil.Process(server.proc.pid).children(recursive=True) + [psutil.Process(server.proc.pid),
                                                                         psutil.Process(server.stack.front.pid)]
    results, started = [], threading.Barrier(9)

    def stream():
        text, error = "", None
        try:
            chunks = sdk(server).completions.create(model="auto", prompt=PROMPT, max_tokens=120, temperature=0,
                                                    stream=True, extra_body={"ignore_eos": True})
            for i, chunk in enumerate(chunks):
                if i == 0:
                    started.wait(30)
                text += chunk.choices[0].text if chunk.choices else ""
        except Exception as e:  # an error is an acceptable end; silence is not
            error = e
        results.append((text, error))

    threads = [threading.Thread(target=stream) for _ in range(8)]
    for t in threads:
        t.start()
    started.wait(60)
    stopper = threading.Thread(target=server.stop)
    stopper.start()
    for t in threads:
        t.join(90)
    stopper.join(90)
    assert len(results) == 8
    for text, error in results:
        assert error is not None or len(text) > 100, (text, error)  # full text (120 tokens) or an error
    assert sum(error is None for _, error in results) == 8  # the drain let every stream finish
    time.sleep(0.5)
    alive = [p for p in tree if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    assert not alive
