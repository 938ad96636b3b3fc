"""The lease socket's two ends in one process (front/lease_socket.py against gateway/lease_socket.py over a
real Unix socket), with a scripted stand-in for the gateway's decisions (`Gateway.answers`): answers by id
while others wait, a grouped admit's several answers, errors as the contract carries them, only the lease
operations served, an operation cancelled on the gateway when its connection goes, and a connection that
closes failing what was in flight while the next one opens. The real gateway on the socket, through the
front: tests/gateway/test_leases.py."""
import asyncio
import os
import stat

import numpy as np
import orjson
import pytest

from contracts.errors import ServingError
from contracts.lease_frames import MAX_FRAME, FrameReader, answer_frame, frame, read_answer
from contracts.tensors import GATEWAY
from front.lease_socket import LeaseSocketClient
from gateway.core import json_answer
from gateway.lease_socket import LeaseSocket
from gateway.request import generate_body

FRONT_KEY = "fk-test"


class ScriptedGateway:
    """A stand-in for Gateway.answers: `renew` answers at once with its ids; `admit` waits for `release`
    (a slot), then answers its stream_id, or each admit of a group one by one; `settle` raises `fail`."""

    def __init__(self):
        self.release = asyncio.Event()
        self.cancelled: list[str] = []
        self.fail: Exception | None = None

    async def answers(self, operation, req, token_ids=None, group_items=None):
        if operation == "renew":
            yield json_answer(req.lease), True
        elif operation == "admit":
            try:
                await self.release.wait()
            except asyncio.CancelledError:
                self.cancelled.append(req.stream_id)
                raise
            names = [a["parameters"]["stream_id"] for a in req.lease["admits"]] \
                if isinstance(req.lease, dict) and "admits" in req.lease else [req.stream_id]
            for i, name in enumerate(names):
                yield json_answer({"granted": name}), i == len(names) - 1
        else:
            raise self.fail


def body(operation, **parameters):
    return {"operation": operation, "front_key": FRONT_KEY, **parameters}


async def served(tmp_path, gateway):
    server = LeaseSocket(str(tmp_path / "gateway.sock"), gateway)
    await server.start()
    client = LeaseSocketClient(server.path, timeout_s=10)
    for _ in range(100):
        if client.ready():
            break
        await asyncio.sleep(0.01)
    return server, client


async def all_answers(op):
    out = []
    while True:
        answer, last = await op.next()
        out.append(orjson.loads(answer))
        if last:
            return out


def test_frames_are_read_whole_whatever_the_reads_cut():
    stream = frame(b"one") + answer_frame(7, 1, b'{"a":1}') + frame(b"")
    for cut in range(1, len(stream) + 1):
        reader, got = FrameReader(), []
        for i in range(0, len(stream), cut):
            got += reader.feed(stream[i:i + cut])
        assert got == [b"one", (7).to_bytes(4, "big") + b'\x01{"a":1}', b""]
    assert read_answer(got[1]) == (7, 1, b'{"a":1}')
    with pytest.raises(ValueError, match="over the limit"):
        FrameReader().feed((MAX_FRAME + 1).to_bytes(4, "big"))


def test_an_operations_body_reads_as_triton_hands_it_to_the_gateway():
    arrays, parameters = generate_body({"operation": "admit", "max_tokens": 12, "token_ids": [5, 6, 7],
                                        "stop_words": ["\n", "END"], "stream": True, "front_key": FRONT_KEY,
                                        "lease": '{"prep": {}}'})
    assert parameters == {"front_key": FRONT_KEY, "lease": '{"prep": {}}'}
    for name, value in arrays.items():  # a batch of one, in the contract's dtype
        assert value.shape[0] == 1 and value.dtype == GATEWAY.input(name).numpy_dtype, name
    assert arrays["operation"].tolist() == [[b"admit"]] and arrays["stop_words"].tolist() == [[b"\n", b"END"]]
    assert arrays["token_ids"].tolist() == [[5, 6, 7]] and arrays["max_tokens"].reshape(-1)[0] == 12
    assert arrays["stream"].dtype == np.bool_
    for bad, field in (({"max_tokens": "twelve"}, "max_tokens"), ({"lease": {"ids": []}}, "lease")):
        with pytest.raises(ServingError) as e:
            generate_body(bad)
        assert e.value.kind == "invalid_argument" and e.value.field == field


def test_answers_come_back_by_id_while_an_earlier_operation_waits(tmp_path):
    async def main():
        gateway = ScriptedGateway()
        server, client = await served(tmp_path, gateway)
        admit = client.operation(body("admit", stream_id="s1", authorization="Bearer sk-x"))
        renew = client.operation(body("renew", lease='{"ids": ["l1", "l2"]}'))
        renewed = await asyncio.wait_for(all_answers(renew), 5)  # the admit still waits for its slot
        gateway.release.set()
        admitted = await asyncio.wait_for(all_answers(admit), 5)
        group = client.operation(body("admit", lease=orjson.dumps({"admits": [
            {"inputs": {"max_tokens": 4}, "parameters": {"stream_id": n, "authorization": "Bearer sk-x"}}
            for n in ("g1", "g2", "g3")]}).decode()))
        grouped = await asyncio.wait_for(all_answers(group), 5)
        await client.close()
        server.close()
        return renewed, admitted, grouped

    renewed, admitted, grouped = asyncio.run(main())
    assert renewed == [{"ids": ["l1", "l2"]}] and admitted == [{"granted": "s1"}]
    assert grouped == [{"granted": "g1"}, {"granted": "g2"}, {"granted": "g3"}]  # one answer each, the last LAST


def test_errors_cross_as_the_contract_and_only_the_lease_operations_are_served(tmp_path):
    async def main():
        gateway = ScriptedGateway()
        gateway.fail = ServingError("rate_limited", "tenant acme is over its tokens", retry_after=2.5)
        server, client = await served(tmp_path, gateway)
        failures = []
        for b in (body("settle", lease='{"leases": []}'), body("generate", text_input="hi"),
                  body("whoami"), {"operation": "renew", "max_tokens": "many"}):
            with pytest.raises(ServingError) as e:
                await all_answers(client.operation(b))
            failures.append(e.value)
        mode = stat.S_IMODE(os.stat(server.path).st_mode)
        await client.close()
        server.close()
        return failures, mode

    (limited, generate, whoami, bad), mode = asyncio.run(main())
    assert (limited.kind, limited.retry_after) == ("rate_limited", 2.5) and "over its tokens" in limited.message
    for refused in (generate, whoami):  # the rest stays Triton's, where it is authorized as ever
        assert refused.kind == "invalid_argument" and refused.field == "operation"
        assert "not served on the lease socket" in refused.message
    assert bad.kind == "invalid_argument" and bad.field == "max_tokens"
    assert mode == 0o600  # the owner's alone


def test_a_closed_connection_fails_what_was_in_flight_and_cancels_it_in_the_gateway(tmp_path):
    """An admit waiting for a slot when its connection goes leaves the gateway's queue (its task cancelled:
    no lease granted to no one), the front's side fails it `unavailable`, and the next connection serves."""
    async def main():
        gateway = ScriptedGateway()
        server, client = await served(tmp_path, gateway)
        waiting = client.operation(body("admit", stream_id="gone", authorization="Bearer sk-x"))
        await asyncio.sleep(0.05)
        client._conn.transport.abort()
        with pytest.raises(ServingError) as e:
            await asyncio.wait_for(waiting.next(), 5)
        for _ in range(100):
            if gateway.cancelled:
                break
            await asyncio.sleep(0.01)
        ready_at_once = client.ready()  # closed: the caller goes through Triton while it reconnects
        for _ in range(300):
            if client.ready():
                break
            await asyncio.sleep(0.01)
        again = await asyncio.wait_for(all_answers(client.operation(body("renew", lease='{"ids": []}'))), 5)
        await client.close()
        server.close()
        return e.value, gateway.cancelled, ready_at_once, again

    err, cancelled, ready_at_once, again = asyncio.run(main())
    assert err.kind == "unavailable" and err.retry_after
    assert cancelled == ["gone"] and ready_at_once is False and again == [{"ids": []}]


def test_a_peer_not_speaking_the_protocol_is_cut_off_and_the_socket_keeps_serving(tmp_path):
    async def main():
        gateway = ScriptedGateway()
        server, client = await served(tmp_path, gateway)
        closed = []
        for garbage in ((MAX_FRAME + 1).to_bytes(4, "big"), frame(b"not json"), frame(b'{"no": "id"}')):
            reader, writer = await asyncio.open_unix_connection(server.path)
            writer.write(garbage)
            closed.append(await asyncio.wait_for(reader.read(), 5) == b"")  # the server closed it, answering nothing
            writer.close()
        still = await asyncio.wait_for(all_answers(client.operation(body("renew", lease='{"ids": ["x"]}'))), 5)
        await client.close()
        server.close()
        return closed, still

    closed, still = asyncio.run(main())
    assert closed == [True, True, True] and still == [{"ids": ["x"]}]


def test_the_client_tries_a_missing_socket_at_most_once_a_retry_interval(tmp_path):
    async def main():
        client = LeaseSocketClient(str(tmp_path / "absent.sock"), retry_s=60)
        tries = [client.ready() for _ in range(5)]
        await asyncio.sleep(0.05)
        started_again = client._connecting is not None or client.ready()
        return tries, started_again

    tries, started_again = asyncio.run(main())
    assert tries == [False] * 5 and started_again is False


def test_a_socket_the_front_cannot_open_is_logged_once_and_triton_serves_meanwhile(tmp_path, caplog):
    async def main():
        client = LeaseSocketClient(str(tmp_path / ("x" * 120) / "gateway.sock"), retry_s=0.01)  # over AF_UNIX's 108
        seen = []
        for _ in range(5):
            seen.append(client.ready())
            await asyncio.sleep(0.03)
        return seen

    with caplog.at_level("WARNING", logger="front.lease_socket"):
        seen = asyncio.run(main())
    assert seen == [False] * 5
    warnings = [r for r in caplog.records if "cannot be opened" in r.getMessage()]
    assert len(warnings) == 1 and "through Triton" in warnings[0].getMessage()


def test_an_operation_the_gateway_never_answers_times_out_and_is_forgotten(tmp_path):
    async def main():
        gateway = ScriptedGateway()  # its admits wait for a slot that never frees
        server, client = await served(tmp_path, gateway)
        client.timeout_s = 0.2
        waiting = client.operation(body("admit", stream_id="never", authorization="Bearer sk-x"))
        with pytest.raises(ServingError) as e:
            await asyncio.wait_for(waiting.next(), 5)
        left = dict(client._conn.ops)
        await client.close()
        server.close()
        return e.value, left

    err, left = asyncio.run(main())
    assert err.kind == "unavailable" and "no answer within 0.2 s" in err.message and left == {}
