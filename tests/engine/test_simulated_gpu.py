"""The simulated GPU engine (a test double for capacity benchmarks): LLMEngine's API and settle rules on
its own clock, and the whole stack serving it (benchmarks/capacity_bench.py's measurement, briefly)."""
import time

import pytest

from cpu_engine import SamplingParams
from cpu_engine.engine import InvalidRequestError
from cpu_engine.simulated_gpu import SimulatedGpuConfig, SimulatedGpuEngine


def collect(engine, rid, n, prompt=(1, 2, 3), is_cancelled=None):
    outs = []
    engine.submit(rid, list(prompt), SamplingParams(max_new_tokens=n), outs.append, is_cancelled=is_cancelled)
    return outs


def test_every_stream_gets_one_token_per_iteration_then_exactly_one_final_output():
    engine = SimulatedGpuEngine(SimulatedGpuConfig(ttft_ms=0, itl_ms=1, max_batch_size=2))
    a, b, c = collect(engine, "a", 3), collect(engine, "b", 5), collect(engine, "c", 2)
    for _ in range(20):
        engine.step()
    for outs, n in ((a, 3), (b, 5), (c, 2)):
        assert [len(o.new_token_ids) for o in outs] == [1] * n and [o.finished for o in outs] == [False] * (n - 1) + [True]
        assert outs[-1].finish_reason == "length" and outs[-1].num_generated_tokens == n
    assert not engine.has_work() and engine.completed == 3
    # max_batch_size 2: c waited for a slot, so its first token came after a's last
    assert c[0].perf["first_token_time_ns"] >= a[-1].perf["first_token_time_ns"]


def test_stop_cancellation_and_a_raising_callback_end_only_their_own_request():
    engine = SimulatedGpuEngine(SimulatedGpuConfig(ttft_ms=0, itl_ms=1))
    stopped, polled, keep = collect(engine, "s", 50), collect(engine, "p", 50, is_cancelled=lambda: True), collect(engine, "k", 4)
    engine.submit("r", [1], SamplingParams(max_new_tokens=50), lambda out: 1 / 0)
    engine.step()
    engine.cancel("s")
    for _ in range(10):
        engine.step()
    assert stopped[-1].finish_reason == "cancelled" and polled[-1].finish_reason == "cancelled"
    assert keep[-1].finish_reason == "length" and len(keep) == 4 and not engine.has_work()


def test_refuses_what_the_engine_would():
    engine = SimulatedGpuEngine(SimulatedGpuConfig(max_seq_len=16))
    with pytest.raises(InvalidRequestError, match="max_seq_len"):
        collect(engine, "x", 20)
    with pytest.raises(InvalidRequestError, match="empty"):
        collect(engine, "y", 2, prompt=())
    with pytest.raises(ValueError, match="sim_itl_ms"):
        SimulatedGpuConfig(itl_ms=0)


def test_its_lora_cache_refuses_a_task_id_without_weights_it_does_not_hold_as_tensorrt_llm_does():
    from contracts.errors import LORA_NOT_CACHED
    from cpu_engine.simulated_gpu import LoraNotCachedError

    engine = SimulatedGpuEngine(SimulatedGpuConfig(lora_cache=2, ttft_ms=0))

    def send(task, weights=False):  # a one-token request, finished by the next step
        engine.submit("r", [1, 2], SamplingParams(max_new_tokens=1), lambda out: None, lora_task_id=task,
                      lora_weights=weights)
        engine.step()

    with pytest.raises(LoraNotCachedError, match=LORA_NOT_CACHED):  # never sent
        send(7)
    send(7, weights=True)
    send(7)  # held now: the task id alone will do
    send(8, weights=True)
    send(7)  # 7 the most recent again: 8 is the least recently used
    send(9, weights=True)
    with pytest.raises(LoraNotCachedError, match="LoRA task 8 not found in cache"):
        send(8)
    send(7)
    assert list(engine.lora_held) == [9, 7]
    plain = SimulatedGpuEngine(SimulatedGpuConfig())  # without the knob: any task id, as before
    plain.submit("r", [1], SamplingParams(max_new_tokens=1), lambda out: None, lora_task_id=3)
    with pytest.raises(ValueError, match="sim_lora_cache"):
        SimulatedGpuConfig(lora_cache=-1)


def test_its_lora_cache_keeps_the_adapters_of_requests_in_flight_as_tensorrt_llm_does():
    from contracts.errors import LORA_CACHE_FULL
    from cpu_engine.simulated_gpu import LoraCacheFullError

    engine = SimulatedGpuEngine(SimulatedGpuConfig(lora_cache=2, ttft_ms=0))
    outs = {}

    def start(rid, task, n, weights=True):
        outs[rid] = []
        engine.submit(rid, [1, 2], SamplingParams(max_new_tokens=n), outs[rid].append, lora_task_id=task,
                      lora_weights=weights)

    start("a", 7, 3)
    start("b", 8, 1)
    with pytest.raises(LoraCacheFullError, match=LORA_CACHE_FULL):  # 7 and 8 both in use: nothing to evict
        start("c", 9, 1)
    engine.step()  # b's one token: 8 is done, 7 still runs
    start("c", 9, 1)  # evicts 8, not 7 (in use, though the least recently used)
    assert list(engine.lora_held) == [7, 9]
    start("d", 7, 1, weights=False)  # 7 held: its task id alone
    engine.cancel("a")
    for _ in range(3):
        engine.step()
    assert all(o[-1].finished for o in outs.values())
    assert engine.lora_held == {7: 0, 9: 0}  # every stream ended, cancelled or not: nothing held in use


def test_the_loop_keeps_the_inter_token_clock():
    engine = SimulatedGpuEngine(SimulatedGpuConfig(ttft_ms=20, itl_ms=5))
    engine.start()
    try:
        outs = collect(engine, "a", 10)
        deadline = time.monotonic() + 10
        while not (outs and outs[-1].finished) and time.monotonic() < deadline:
            time.sleep(0.01)
    finally:
        engine.shutdown()
    times = [o.perf["last_token_time_ns"] for o in outs]
    assert len(outs) == 10 and outs[-1].finish_reason == "length"
    assert times[0] - outs[0].perf["arrival_time_ns"] >= 20e6  # not before its TTFT
    assert times[-1] - times[0] >= 9 * 5e6 * 0.9  # one token per iteration, not a burst


@pytest.mark.integration
def test_the_stack_serves_the_simulated_engine_through_every_layer(checkpoint, tmp_path):
    """capacity_bench's own measurement, 4 streams for a few seconds per layer, two engine instances:
    every layer streams whole requests without an error, and each process's cost per token is reported."""
    import json

    from benchmarks.capacity_bench import main

    out = tmp_path / "capacity.json"
    assert main(["--levels", "4", "--duration", "3", "--warmup", "1", "--clients", "1",
                 "--layers", "ensemble,gateway,front,engine_relay", "--output-tokens", "32",
                 "--engine-instances", "2", "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    runs, itl_ms = report["runs"], report["workload"]["itl_ms"]
    assert [r["layer"] for r in runs] == ["ensemble", "gateway", "front", "engine_relay"]
    assert report["workload"]["output_tokens"] == 32
    for r in runs:
        assert r["errors"] == 0 and r["completed_requests"] >= 1 and r["itl_ms"]["p50"] is not None, r
        # the simulated engine's roofline: each of the 4 streams gets a token at most every itl_ms (one step
        # of catch-up after a stall, one more at the window's edge); no layer can count more than the engine
        # made (10% for chunks made before the window and read in it, on a loaded host)
        ceiling = 4 * (1000 / itl_ms + 2 / r["window_s"])
        assert 0 < r["tok_s"] <= ceiling * 1.1, (r["tok_s"], ceiling)
        # a process's CPU per token is its cores over the tokens a second (both rounded in the report)
        for name, us in r["cpu_us_per_token"].items():
            assert us == pytest.approx(1e6 * r["cpu_cores"][name] / r["tok_s"], rel=0.01,
                                       abs=1e6 * 0.0005 / r["tok_s"] + 0.1), name
    assert runs[0]["cpu_us_per_token"]["tritonserver"] > 0
    assert runs[1]["cpu_us_per_token"]["gateway_0_0"] > 0 and runs[2]["cpu_us_per_token"]["front"] > 0
    assert runs[3]["cpu_us_per_token"]["relay"] > 0  # the floor peer's own process, counted apart
    # each token read wakes the process that reads it, or comes while it is awake: the wake-ups a token of the
    # layer's own process and of the clients, counted over every thread (a process that slept through the
    # window, as the front does while the relay serves, counts next to none)
    for r, process in ((runs[2], "front"), (runs[3], "relay")):
        switches = r["switches_per_token"]
        assert set(switches) == {process, "clients"} | ({"front"} if process == "relay" else set()), switches
        assert 0 < switches[process]["voluntary"] < 20 and 0 < switches["clients"]["voluntary"] < 20, switches
    assert runs[3]["switches_per_token"]["front"]["voluntary"] < runs[2]["switches_per_token"]["front"]["voluntary"]


@pytest.mark.parametrize("nap_ms", [0.0, 2.0])
def test_the_tcp_relay_copies_both_ways_and_passes_a_close_on(nap_ms):
    """benchmarks/peer/tcp_relay.py, the capacity bench's floor peer: what a client sends reaches the target
    and the target's answer the client, byte for byte, with bytes sent before the target's connection is
    open kept in order; the target closing closes the client. So too with its --nap-ms diagnostic (its loop
    sleeps after each turn instead of waiting for a read)."""
    import asyncio

    from benchmarks.peer.tcp_relay import serve

    async def run():
        got = []

        async def target(reader, writer):
            data = await reader.readexactly(10)
            got.append(data)
            writer.write(data[::-1] * 1000)
            await writer.drain()
            writer.close()

        server = await asyncio.start_server(target, "127.0.0.1", 0)
        to = server.sockets[0].getsockname()[:2]
        ready = asyncio.Event()
        probe = await asyncio.start_server(lambda r, w: None, "127.0.0.1", 0)
        port = probe.sockets[0].getsockname()[1]
        probe.close()
        await probe.wait_closed()
        relay = asyncio.ensure_future(serve(("127.0.0.1", port), to, ready.set, nap_ms=nap_ms))
        await asyncio.wait_for(ready.wait(), 5)
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"01234")  # before the relay's own connection is open
        writer.write(b"56789")
        answer = await asyncio.wait_for(reader.read(), 5)  # to EOF: the target's close passed on
        relay.cancel()
        server.close()
        return got, answer

    got, answer = asyncio.run(run())
    assert got == [b"0123456789"] and answer == b"9876543210" * 1000


def test_the_relays_fast_lane_diagnostic_reads_each_token_and_relays_the_same_bytes(checkpoint, monkeypatch):
    """tcp_relay.py --fast-lane: each streamed token's read (one chunk of one `data:` event) also goes through
    the front's fast lane on a stand-in stream, once; the head and the end do not; the client gets the
    target's bytes unchanged."""
    import asyncio

    from benchmarks.fast_lane_bench import HEAD, engine_read
    from benchmarks.peer import tcp_relay
    from front.engine_http import _Connection

    fed = []
    real = _Connection.data_received
    monkeypatch.setattr(_Connection, "data_received", lambda self, data: (fed.append(data), real(self, data)))
    tokens = [engine_read(i) for i in (1000, 1001, 1002)]

    async def run():
        head_out = asyncio.Event()

        async def until(done):
            for _ in range(2000):
                if done():
                    return
                await asyncio.sleep(0.005)
            raise TimeoutError

        async def target(reader, writer):  # each part written once the relay has read the one before
            await reader.readexactly(4)
            writer.write(HEAD)
            await head_out.wait()
            for i, data in enumerate(tokens):
                writer.write(data)
                await until(lambda: len(fed) > i)
            writer.write(b"0\r\n\r\n")
            await writer.drain()
            writer.close()

        server = await asyncio.start_server(target, "127.0.0.1", 0)
        probe = await asyncio.start_server(lambda r, w: None, "127.0.0.1", 0)
        port = probe.sockets[0].getsockname()[1]
        probe.close()
        await probe.wait_closed()
        ready = asyncio.Event()
        relay = asyncio.ensure_future(tcp_relay.serve(("127.0.0.1", port), server.sockets[0].getsockname()[:2],
                                                      ready.set, fast_lane="auto"))
        await asyncio.wait_for(ready.wait(), 30)
        fed.clear()  # the stand-in's own first step
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"POST")
        head = await asyncio.wait_for(reader.readexactly(len(HEAD)), 10)
        head_out.set()
        answer = head + await asyncio.wait_for(reader.read(), 20)
        relay.cancel()
        server.close()
        return answer

    try:
        answer = asyncio.run(run())
    finally:
        tcp_relay._lane = None
    assert answer == HEAD + b"".join(tokens) + b"0\r\n\r\n"
    assert fed == tokens
