"""The front's admits in groups: those that arrive while `in_flight` groups are on their way unanswered go
together once one has its first answer (or after the gate), each gets its own answer or error, and a
group's failure is its own."""
import asyncio
import json

import pytest

from contracts.errors import ServingError, from_transport
from contracts.tensors import MAX_ADMITS_PER_GROUP
from front.grouped_admits import GroupedAdmits


def item(stream_id: str, size: int = 0) -> bytes:
    return json.dumps({"parameters": {"stream_id": stream_id}, "pad": "x" * size}).encode()


def ids(items: list[bytes]) -> list[str]:
    return [json.loads(i)["parameters"]["stream_id"] for i in items]


class Gateway:
    """Answers each group when told to (`answer`), as the gateway's several answers to one request."""

    def __init__(self):
        self.groups: list[list[str]] = []
        self.alone: list[str] = []  # the groups of one, sent as a single admit
        self.replies: dict[int, asyncio.Queue] = {}

    async def send(self, items):
        n = len(self.groups)
        self.groups.append(ids(items))
        queue = self.replies.setdefault(n, asyncio.Queue())
        while True:
            answers = await queue.get()
            if answers is None:
                return
            if isinstance(answers, Exception):
                raise answers
            yield answers

    async def send_one(self, payload):
        """A group of one goes alone: its grant, or its refusal raised."""
        (stream_id,) = ids([payload])
        self.alone.append(stream_id)
        async for answers in self.send([payload]):
            if stream_id in answers:
                answer = answers[stream_id]
                if "error" in answer:
                    raise from_transport(answer["error"])
                return answer
        raise ServingError("internal", "no answer")

    def grouped(self, **kw) -> GroupedAdmits:
        return GroupedAdmits(self.send_one, self.send, lambda payload: payload, **kw)

    def answer(self, group: int, answers) -> None:
        self.replies.setdefault(group, asyncio.Queue()).put_nowait(answers)


def grant(stream_id):
    return {"lease": f"lease-{stream_id}"}


def test_admits_that_arrive_while_a_group_is_on_its_way_go_together_after_its_first_answer():
    gw = Gateway()
    admits = gw.grouped(gate_s=5.0, in_flight=1)

    async def scenario():
        first = asyncio.ensure_future(admits.admit("a", item("a")))
        await asyncio.sleep(0.01)
        later = [asyncio.ensure_future(admits.admit(s, item(s))) for s in ("b", "c", "d")]
        await asyncio.sleep(0.01)
        assert gw.groups == [["a"]]  # b, c and d wait for a's group's first answer
        gw.answer(0, {"a": grant("a")})
        gw.answer(0, None)
        assert await first == grant("a")
        await asyncio.sleep(0.01)
        assert gw.groups == [["a"], ["b", "c", "d"]]
        gw.answer(1, {"b": grant("b"), "c": {"error": "[kind=rate_limited status=429 retry_after=2.000] slow down"}})
        gw.answer(1, {"d": grant("d")})
        gw.answer(1, None)
        return await asyncio.gather(*later, return_exceptions=True)

    b, c, d = asyncio.run(scenario())
    assert b == grant("b") and d == grant("d")
    assert gw.alone == ["a"]  # a group of one goes as a single admit
    assert isinstance(c, ServingError) and c.kind == "rate_limited" and c.retry_after == 2.0


def test_a_group_whose_admits_all_wait_holds_the_next_no_longer_than_the_gate():
    gw = Gateway()
    admits = gw.grouped(gate_s=0.05, in_flight=1)

    async def scenario():
        waiting = asyncio.ensure_future(admits.admit("queued", item("queued")))
        await asyncio.sleep(0.01)
        other = asyncio.ensure_future(admits.admit("other", item("other")))
        await asyncio.sleep(0.01)
        assert gw.groups == [["queued"]]
        await asyncio.sleep(0.1)
        assert gw.groups == [["queued"], ["other"]]  # the gate opened with no answer to the first group
        gw.answer(1, {"other": grant("other")})
        gw.answer(1, None)
        assert await other == grant("other")
        assert not waiting.done()
        gw.answer(0, {"queued": grant("queued")})
        gw.answer(0, None)
        return await waiting

    assert asyncio.run(scenario()) == grant("queued")


def test_a_groups_failure_fails_its_own_admits_only_and_an_unanswered_admit_fails():
    gw = Gateway()
    admits = gw.grouped(gate_s=0.01, in_flight=1)

    async def scenario():
        a = asyncio.ensure_future(admits.admit("a", item("a")))
        await asyncio.sleep(0.03)
        b = asyncio.ensure_future(admits.admit("b", item("b")))
        c = asyncio.ensure_future(admits.admit("c", item("c")))
        await asyncio.sleep(0.03)
        assert gw.groups == [["a"], ["b", "c"]]
        gw.answer(0, ServingError("unavailable", "tritonserver is being replaced", retry_after=1.0))
        gw.answer(1, {"b": grant("b")})
        gw.answer(1, None)  # the group ends without an answer for c
        return await asyncio.gather(a, b, c, return_exceptions=True)

    a, b, c = asyncio.run(scenario())
    assert isinstance(a, ServingError) and a.kind == "unavailable"
    assert b == grant("b")
    assert isinstance(c, ServingError) and c.kind == "internal" and "did not answer" in c.message


@pytest.mark.parametrize("size, per_group", [(0, MAX_ADMITS_PER_GROUP), (300_000, 3)])
def test_a_group_holds_no_more_than_the_gateway_takes(size, per_group):
    """At most MAX_ADMITS_PER_GROUP admits, and no more bytes than the gateway's JSON parameter holds."""
    gw = Gateway()
    admits = gw.grouped(gate_s=0.001, in_flight=1)
    n = per_group + 5

    async def scenario():
        first = asyncio.ensure_future(admits.admit("first", item("first")))
        await asyncio.sleep(0.01)
        rest = [asyncio.ensure_future(admits.admit(f"s{i}", item(f"s{i}", size))) for i in range(n)]
        await asyncio.sleep(0.01)
        answered = 0
        while not all(r.done() for r in rest):
            for g in range(answered, len(gw.groups)):  # each group answered whole, once it is sent
                gw.answer(g, {s: grant(s) for s in gw.groups[g]})
                gw.answer(g, None)
            answered = len(gw.groups)
            await asyncio.sleep(0.01)
        await first
        return [await r for r in rest]

    got = asyncio.run(scenario())
    assert got == [grant(f"s{i}") for i in range(n)]
    assert [len(g) for g in gw.groups[1:]] == [min(per_group, n - k) for k in range(0, n, per_group)]


def test_an_admit_withdrawn_before_it_is_sent_never_reaches_the_gateway():
    gw = Gateway()
    admits = gw.grouped(gate_s=5.0, in_flight=1)

    async def scenario():
        first = asyncio.ensure_future(admits.admit("a", item("a")))
        await asyncio.sleep(0.01)
        left = asyncio.ensure_future(admits.admit("left", item("left")))
        stays = asyncio.ensure_future(admits.admit("stays", item("stays")))
        await asyncio.sleep(0.01)
        assert admits.withdraw("left") and not admits.withdraw("a")  # a is on its way already
        with pytest.raises(ServingError) as e:
            await left
        gw.answer(0, {"a": grant("a")})
        gw.answer(0, None)
        await first
        await asyncio.sleep(0.01)
        gw.answer(1, {"stays": grant("stays")})
        gw.answer(1, None)
        return e.value, await stays

    err, stays = asyncio.run(scenario())
    assert err.kind == "cancelled" and stays == grant("stays")
    assert gw.groups == [["a"], ["stays"]]


def test_with_two_in_flight_a_second_group_goes_at_once_and_a_third_waits_for_an_answer():
    """The default: an admit waits only while two groups are on their way without an answer, so a gateway
    that keeps up sees every admit at once, and one that falls behind gets them in groups."""
    gw = Gateway()
    sent = []
    admits = gw.grouped(gate_s=5.0, on_sent=sent.append)
    assert admits.in_flight == 2

    async def scenario():
        futures = [asyncio.ensure_future(admits.admit("a", item("a")))]
        await asyncio.sleep(0.01)
        futures.append(asyncio.ensure_future(admits.admit("b", item("b"))))
        await asyncio.sleep(0.01)
        assert gw.groups == [["a"], ["b"]]  # b did not wait for a's answer
        futures += [asyncio.ensure_future(admits.admit(s, item(s))) for s in ("c", "d")]
        await asyncio.sleep(0.01)
        assert gw.groups == [["a"], ["b"]]  # two unanswered: c and d wait, together
        gw.answer(1, {"b": grant("b")})
        await asyncio.sleep(0.01)
        assert gw.groups == [["a"], ["b"], ["c", "d"]]
        for g, names in enumerate(gw.groups):
            gw.answer(g, {s: grant(s) for s in names})
            gw.answer(g, None)
        return await asyncio.gather(*futures)

    assert asyncio.run(scenario()) == [grant(s) for s in "abcd"]
    assert sent == [1, 1, 2]  # what each request carried, as the front's metrics count it
