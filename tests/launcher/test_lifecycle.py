"""The stack's lifecycle against real processes: a killed engine stub comes back by itself, as often as it
is killed, and every client of a dead engine gets an error, never an empty success; SIGTERM drains
in-flight streams and leaves no process behind. (A client that leaves the front stops the engine:
tests/front/test_front_server.py.)"""
import threading
import time
import urllib.error
import urllib.request

import openai
import psutil
import pytest

from launcher.stack import python_stubs
from tests.support.server import TritonServer

pytestmark = pytest.mark.integration
KEY = "sk-demo-acme-enterprise"
PROMPT = "The capital of France is"
ENSEMBLE_LOAD_LINE = "unable to create stream for ensemble"  # Triton logs it at every load of the ensemble


def sdk(server):
    return openai.OpenAI(base_url=f"{server.front_url}/v1", api_key=KEY, max_retries=0, timeout=120)


def status(url: str) -> int:
    try:
        with urllib.request.urlopen(url, timeout=5) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code
    except OSError:
        return 0


def kill_engine_stub(server, wait_s: float = 2.0, fresh_from: set | None = None) -> int:
    """SIGKILL the engine's stub (a loading one too); waits up to wait_s for one to exist. `fresh_from`:
    wait for a stub that is none of these pids and kill it the moment it appears (as it starts, before
    it has told the server it runs), or, if none appears within wait_s, whichever exists then."""
    deadline = time.monotonic() + wait_s
    while True:
        stub = python_stubs(server.proc.pid).get("tensorrt_llm")
        if stub is not None and (not fresh_from or stub not in fresh_from or time.monotonic() >= deadline):
            break
        if time.monotonic() >= deadline:
            break
        if not fresh_from:
            time.sleep(0.05)
    assert stub is not None, f"no engine stub to kill\n{server.log_tail()}"
    psutil.Process(stub).kill()
    return stub


def answer_within(server, seconds: float):
    """The first greedy answer the front gives within `seconds`; errors meanwhile are retried."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            return sdk(server).completions.create(model="auto", prompt=PROMPT, max_tokens=4, temperature=0)
        except openai.APIError:
            time.sleep(0.5)
    return None


def test_a_killed_engine_stub_is_reloaded_and_serves_again():
    """Twice, far apart: the second death comes after the first reload succeeded (Triton 2.51's `load`
    leaves a model whose files did not change as it is; only the ensemble was reloaded, in a loop)."""
    with TritonServer(front=True) as server:
        for n in (1, 2):
            stub = kill_engine_stub(server)
            answer = answer_within(server, 60)
            assert answer is not None, server.log_tail()
            assert answer.choices[0].text.strip() and answer.usage.completion_tokens > 0, answer  # not empty
            assert "Paris" in answer.choices[0].text, answer
            assert server.stack.reloads == ["tensorrt_llm"] * n
            assert python_stubs(server.proc.pid)["tensorrt_llm"] != stub
        assert status(f"http://{server.http_url}/v2/models/tensorrt_llm/ready") == 200
        assert status(f"{server.front_url}/health/ready") == 200


class Client(threading.Thread):
    """Streams completions through the front one after another until told to stop, and records each:
    (start, first text, last text, end, text, finish_reason, error or None), times by time.monotonic()."""

    def __init__(self, server, max_tokens: int = 48):
        super().__init__(daemon=True)
        self.server, self.max_tokens = server, max_tokens
        self.done = threading.Event()
        self.flowing = False  # the current stream has had text
        self.records: list[tuple] = []

    def run(self):
        client = sdk(self.server)
        while not self.done.is_set():
            start, first, last, text, finish, error = time.monotonic(), None, None, "", None, None
            try:
                chunks = client.completions.create(model="auto", prompt=PROMPT, max_tokens=self.max_tokens,
                                                   temperature=0, stream=True, extra_body={"ignore_eos": True})
                for chunk in chunks:
                    for choice in chunk.choices:
                        if choice.text:
                            last = time.monotonic()
                            first = first or last
                            self.flowing = True
                        text += choice.text or ""
                        finish = choice.finish_reason or finish
            except openai.APIError as e:
                error = e
            self.flowing = False
            self.records.append((start, first, last, time.monotonic(), text, finish, error))
            if error is not None:
                time.sleep(0.2)


def test_three_engine_deaths_in_a_row_are_each_surfaced_and_the_engine_comes_back():
    """Issue 27: the engine stub killed 3 times in a row while clients stream through the front: the
    serving stub; 2 s later the stub the launcher is loading; then the next stub the moment it starts
    (1-5 s later: a stub killed before it has told Triton it runs hangs that load for good, and the
    launcher replaces tritonserver). Every stream running at a kill ends with a 503 engine_unavailable
    within 2 s of it, no request ends in an empty success, readiness goes false after each kill, the
    engine model itself is loaded again and serves within 60 s of the last kill, and then nothing
    loops: no reload, no restart, no repeated line in Triton's log while idle."""
    with TritonServer(front=True) as server:
        ready_url = f"{server.front_url}/health/ready"
        samples, sampling = [], threading.Event()

        def sample_readiness():
            while not sampling.is_set():
                samples.append((time.monotonic(), status(ready_url)))
                time.sleep(0.1)
        sampler = threading.Thread(target=sample_readiness, daemon=True)
        sampler.start()
        clients = [Client(server) for _ in range(3)]
        for c in clients:
            c.start()
        deadline = time.monotonic() + 60  # until every client's stream is flowing
        while time.monotonic() < deadline and not all(c.flowing for c in clients):
            time.sleep(0.05)

        kills = [(time.monotonic(), kill_engine_stub(server))]
        time.sleep(2.0)  # (the first death can take tritonserver with it: then the stub of the new one)
        kills.append((time.monotonic(), kill_engine_stub(server, wait_s=3.0)))
        time.sleep(1.0)
        fresh = kill_engine_stub(server, wait_s=4.0, fresh_from={pid for _, pid in kills})
        kills.append((time.monotonic(), fresh))
        assert all(1.0 <= b[0] - a[0] <= 5.1 for a, b in zip(kills, kills[1:])), kills
        answer = answer_within(server, 60)
        time.sleep(1.0)  # let each client's current stream end
        for c in clients:
            c.done.set()
        for c in clients:
            c.join(120)
        sampling.set()
        sampler.join(10)
        assert answer is not None, f"no answer within 60 s of the last kill\n{server.log_tail()}"
        assert "Paris" in answer.choices[0].text, answer

        records = [r for c in clients for r in c.records]
        t0 = kills[0][0]
        timeline = "kills at " + ", ".join(f"{k - t0:.2f}" for k, _ in kills) + "; streams (start, first, last, end):\n" + \
            "\n".join(f"{r[0] - t0:.2f} {r[1] and r[1] - t0} {r[2] and r[2] - t0} {r[3] - t0:.2f} {len(r[4])} chars, "
                      f"{r[5]}, {r[6]!r}" for r in records) + "\n" + server.log_tail(40)
        # no success that is not one: a stream that ends without an error carries every token it asked for
        for start, first, last, end, text, finish, error in records:
            if error is None:
                assert text and finish == "length", (text, finish, timeline)
            else:
                code = (error.body or {}).get("code") if isinstance(error.body, dict) else None
                assert code == "engine_unavailable", (error, error.body, timeline)
        # every stream running at a kill (text before it, and not all of its text) ends with that error
        # within 2 s of it
        running = {k: [r for r in records if r[1] is not None and r[1] < k < r[3] and not (r[6] is None and r[2] < k)]
                   for k, _ in kills}
        assert running[kills[0][0]], "no stream was running at the first kill"
        for k, streams in running.items():
            for start, first, last, end, text, finish, error in streams:
                assert error is not None, f"a stream running at a kill ended in a success: {text!r}\n{timeline}"
                assert end - k <= 2.0, f"the error came {end - k:.2f} s after the kill\n{timeline}"
        # readiness goes false after each kill (before the next), and is true again at the end
        for i, (k, _) in enumerate(kills):
            until = kills[i + 1][0] if i + 1 < len(kills) else k + 5.0
            assert any(code == 503 for t, code in samples if k <= t <= until), \
                f"readiness never false after kill {i + 1}: {[(round(t - k, 2), c) for t, c in samples if t >= k]}"
        assert status(ready_url) == 200

        # the engine model itself is back (a stub of its own, ready in Triton: reloaded, or loaded by the
        # new tritonserver), and nothing loops once idle
        assert set(server.stack.reloads) <= {"tensorrt_llm"}
        assert server.stack.reloads or server.stack.triton_restarts, "the engine came back by itself?"
        assert python_stubs(server.proc.pid)["tensorrt_llm"] not in {pid for _, pid in kills}
        assert status(f"http://{server.http_url}/v2/models/tensorrt_llm/ready") == 200
        reloads, restarts = list(server.stack.reloads), list(server.stack.triton_restarts)
        log = server.log_path.read_text(errors="replace")
        time.sleep(3.0)
        assert server.stack.reloads == reloads and server.stack.triton_restarts == restarts
        assert server.log_path.read_text(errors="replace")[len(log):].count(ENSEMBLE_LOAD_LINE) == 0


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


@pytest.mark.parametrize("model", ["auto", "demo-support"])  # the front's direct engine stream; the gateway's
def test_sigterm_after_a_cancelled_stream_unloads_every_model(model):
    """A client that cancels its stream must not leave the gateway with a request Triton counts as in flight
    (no final response): the unload at SIGTERM would then wait for Triton's exit timeout and fail."""
    import httpx2 as httpx

    server = TritonServer(front=True, drain_timeout_s=10).start()
    try:
        body = {"model": model, "prompt": PROMPT, "max_tokens": 200, "stream": True, "ignore_eos": True}
        with httpx.Client(timeout=60) as c, c.stream("POST", f"{server.front_url}/v1/completions", json=body,
                                                     headers={"Authorization": f"Bearer {KEY}"}) as r:
            assert r.status_code == 200
            for i, _line in enumerate(r.iter_lines()):
                if i >= 4:
                    break  # leaves the stream: the front cancels it
        time.sleep(1.5)  # the cancel reaches the gateway (its poll) and the engine
    finally:
        server.stop()
    log = server.log_path.read_text(errors="replace")
    assert "Exit timeout expired" not in log, server.log_tail()
    assert server.proc.returncode == 0, server.log_tail()
