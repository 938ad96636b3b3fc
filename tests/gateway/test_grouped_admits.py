"""A grouped admit (the front's admits that queued while its previous group was on its way, one request):
each item read as a single admit's tensors are, decided as it would be alone, answered with the others
decided at the same time; only the front's group admits anything."""
import asyncio
import json

import pytest

from contracts.errors import ServingError, from_transport
from gateway.core import GatewayRequest
from gateway.request import grouped_admits
from gateway.tenants import hash_key
from tests.gateway.test_gateway_lib import FakeBackend, _hold_every_slot, make_gateway


class LeasingBackend(FakeBackend):
    def engine_identity(self, model):
        return model

    def engine_call(self, model, req, prep, tenant):
        return {"model": model, "inputs": {"input_ids": [list(prep.token_ids)]}}


def item(stream_id: str, key: str = "k-acme", **inputs) -> dict:
    values = {"text_input": "hi", "max_tokens": 40, "model": "big", "stream": True, "operation": "admit", **inputs}
    return {"inputs": values, "parameters": {"stream_id": stream_id, "authorization": f"Bearer {key}"}}


def group(*items, front_key: str | None = "fk") -> GatewayRequest:
    return GatewayRequest(None, None, front_key=front_key, lease={"admits": list(items)})


async def answers(gw, req) -> list[tuple[dict, bool]]:
    return [(answer, last) async for answer, last in gw.leases.admit_group(req, grouped_admits)]


def error_of(answer: dict) -> ServingError:
    return from_transport(answer["error"])


def test_a_group_answers_each_admit_at_once_when_none_waits():
    gw, reg = make_gateway(LeasingBackend(), front_key_sha256=hash_key("fk"))
    got = asyncio.run(answers(gw, group(item("a"), item("b", key="k-nope"), item("c", max_tokens="many"))))
    assert [last for _, last in got] == [True]  # one answer for all three
    admits = got[0][0]["admits"]
    assert set(admits) == {"a", "b", "c"}
    assert admits["a"]["lease"] in gw.leases.live and admits["a"]["model"] == "big"
    assert error_of(admits["b"]).kind == "unauthenticated"
    bad = error_of(admits["c"])
    assert bad.kind == "invalid_argument" and bad.field == "max_tokens"
    assert gw.limiter.inflight["acme"] == 1  # only a's slot is held
    json.dumps(got[0][0])  # what the adapter sends


async def one_waits(gw):
    """A group of an admit that waits for an engine slot (every slot held) and one refused at once: the
    group's answers, its first answer, and the slots, once the admit waits in the queue."""
    slots, hold = _hold_every_slot(gw)
    await hold
    stream = gw.leases.admit_group(group(item("waits"), item("refused", key="k-nope")), grouped_admits)
    first = await asyncio.wait_for(stream.__anext__(), 1)
    while slots.queued == 0:
        await asyncio.sleep(0.001)
    return stream, first, slots


def test_an_admit_that_waits_is_answered_later_on_its_own():
    gw, _ = make_gateway(LeasingBackend(), front_key_sha256=hash_key("fk"))

    async def scenario():
        stream, first, slots = await one_waits(gw)
        slots.release("someone-else")
        second = await asyncio.wait_for(stream.__anext__(), 1)
        return first, second

    (first, last1), (second, last2) = asyncio.run(scenario())
    assert set(first["admits"]) == {"refused"} and not last1
    assert set(second["admits"]) == {"waits"} and last2 and "lease" in second["admits"]["waits"]


def test_a_group_closed_while_an_admit_waits_leaves_nothing_queued_or_held():
    gw, _ = make_gateway(LeasingBackend(), front_key_sha256=hash_key("fk"))

    async def scenario():
        stream, _, slots = await one_waits(gw)
        await stream.aclose()  # the group's caller is gone (its request cancelled)
        await asyncio.sleep(0.01)
        return slots

    slots = asyncio.run(scenario())
    assert slots.queued == 0 and gw.leases.live == {}
    assert gw.limiter.reserved["acme"] == 0 and gw.limiter.inflight["acme"] == 0


def test_only_the_fronts_group_admits_and_an_items_own_front_key_counts_for_nothing():
    gw, _ = make_gateway(LeasingBackend(), front_key_sha256=hash_key("fk"))
    claims = item("a")
    claims["parameters"]["front_key"] = "fk"
    for req in (group(claims, front_key=None), group(claims, front_key="not-the-key")):
        with pytest.raises(ServingError) as e:
            asyncio.run(answers(gw, req))
        assert e.value.kind == "permission_denied"
    assert gw.leases.live == {}


@pytest.mark.parametrize("lease, problem", [
    ({"admits": []}, "1 to 256"),
    ({"admits": [{"inputs": {}}]}, "1 to 256"),
    ({"admits": [item("same"), item("same")]}, "its own stream_id"),
    ({"admits": [{"inputs": {}, "parameters": {}}]}, "its own stream_id"),
    ({}, "1 to 256"),
])
def test_a_malformed_group_is_a_400_naming_lease(lease, problem):
    with pytest.raises(ServingError) as e:
        grouped_admits(GatewayRequest(None, None, front_key="fk", lease=lease))
    assert e.value.kind == "invalid_argument" and e.value.field == "lease" and problem in e.value.message


@pytest.mark.parametrize("inputs, field", [
    ({"nonsense": 1}, "nonsense"),
    ({"text_input": 5}, "text_input"),
    ({"max_tokens": "many"}, "max_tokens"),
    ({"operation": "settle"}, "operation"),
])
def test_an_items_bad_input_is_its_own_400_naming_the_field(inputs, field):
    (stream_id, got), = grouped_admits(group(item("x", **inputs)))
    assert stream_id == "x" and isinstance(got, ServingError)
    assert got.kind == "invalid_argument" and got.field == field


def test_an_item_reads_as_the_same_admit_its_tensors_would():
    """What the front sends a grouped item (Triton JSON values) and a single admit (tensors) give one request."""
    ids = item("x", token_ids=[1, 2, 3], stop_words=["END", "STOP"], temperature=0.5)
    del ids["inputs"]["text_input"]  # a prompt as token ids
    (_, req), = grouped_admits(group(ids))
    assert req.api_key == "k-acme" and req.max_tokens == 40 and req.model == "big" and req.stream
    assert req.stop_words == ["END", "STOP"] and req.prompt_ids == [1, 2, 3]
    assert req.sampling.temperature == pytest.approx(0.5) and req.stream_id == "x" and req.front_key == "fk"


def test_a_batch_lines_lease_is_the_tenants_at_the_batch_tier_and_a_refusal_it_retries_leaves_no_row():
    """The batch worker's lines take leases (its key, on_behalf_of): the tenant's limits at the batch tier,
    one ledger row at the settle, none for a refusal the worker waits out and retries (as through the
    gateway's stream)."""
    gw, _ = make_gateway(LeasingBackend(), front_key_sha256=hash_key("fk"), tokens_per_minute=60)
    rows = []
    gw.worker_key_sha256, gw.ledger = hash_key("wk"), type("L", (), {"append": lambda self, r: rows.append(
        json.loads(r))})()

    def line(max_tokens, key="wk"):
        return GatewayRequest(key, max_tokens, text="hi", model="big", front_key="fk", on_behalf_of="acme",
                              tier="batch", batch_id="batch_1")

    grant = asyncio.run(gw.leases.operation("admit", line(40)))
    lease = gw.leases.live[grant["lease"]]
    assert lease.admitted.batch and lease.admitted.tenant.name == "acme"
    with pytest.raises(ServingError) as e:  # the tenant's tokens a minute are reserved by the first
        asyncio.run(gw.leases.operation("admit", line(40)))
    assert e.value.kind == "rate_limited" and rows == []
    with pytest.raises(ServingError) as e:  # only the worker's key acts for a tenant
        asyncio.run(gw.leases.operation("admit", line(4, key="k-acme")))
    assert e.value.kind == "permission_denied"
    asyncio.run(gw.leases.operation("settle", GatewayRequest(None, None, front_key="fk", lease={
        "id": grant["lease"], "num_output_tokens": 3, "outcome": "success"})))
    assert [(r["tenant"], r["tier"], r["batch_id"], r["outcome"], r["error_kind"]) for r in rows] == [
        ("unknown", "", "batch_1", "error", "permission_denied"),  # as through the gateway's stream
        ("acme", "batch", "batch_1", "success", "")]
