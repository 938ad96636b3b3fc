"""LoRA adapters in the gateway (issue 20): ACL, adapter as the model name, not-found, /v1/models listing,
metrics naming the adapter, and the engine tensors (lora_task_id; TensorRT-LLM weights on first use)."""
import asyncio
import json

import numpy as np
import pytest

from contracts.generation import EngineStep
from gateway.admission import Admission
from gateway.core import Gateway, GatewayRequest
from gateway.edges import Preprocessed
from gateway.engine_limits import EngineLimits, RepositoryEngineLimits
from gateway.metrics import GatewayMetrics, MemoryRegistry
from gateway.ratelimit import MemoryLimiter
from gateway.tenants import parse_config
from gateway.triton_backend import TritonBackend
from contracts.errors import ServingError
from text.detokenize import Detokenizer
from cpu_engine.lora import task_id
from tests.support.tenants import Tenant, gateway_config


class RecordingBackend:
    def __init__(self):
        self.calls = []

    async def tokenize(self, req):
        ids = list(req.text.encode())
        return Preprocessed.from_tensors({"INPUT_ID": np.array([ids]), "REQUEST_INPUT_LEN": np.array([[len(ids)]])})

    async def engine_stream(self, model, req, prep, tenant):
        self.calls.append((model, req.adapter))
        for i in range(req.max_tokens):
            yield EngineStep([ord("a") + i])

    async def engine_stop(self, model, req):
        pass


def adapter_dir(tmp_path, *names):
    for n in names:
        (tmp_path / n).mkdir(parents=True)
        (tmp_path / n / "adapter_config.json").write_text("{}")
    return tmp_path


def make(tmp_path, adapters=("support", "legal"), lora=True):
    cfg = parse_config(gateway_config(
        [Tenant("acme", allowed_adapters=("support",)), Tenant("wild", allowed_adapters=("*",)), Tenant("none")],
        models={"base": 4096, "other": 1024}, default_model="base"))
    folder = adapter_dir(tmp_path / "loras", *adapters)
    limits = {"base": EngineLimits(lora_dir=str(folder) if lora else None), "other": EngineLimits()}
    reg, backend = MemoryRegistry(), RecordingBackend()
    gw = Gateway(lambda: cfg, MemoryLimiter(), Admission(4, 16, 1.0), GatewayMetrics(reg), backend,
                 Detokenizer([bytes([i]) for i in range(256)]), engine_limits=limits.__getitem__)
    return gw, reg, backend


def run(gw, req):
    async def go():
        return [c async for c in gw.handle(req)]
    return asyncio.run(go())


def refused(gw, req) -> ServingError:
    with pytest.raises(ServingError) as e:
        run(gw, req)
    return e.value


def test_an_allowed_adapter_reaches_the_engine_and_is_named_in_metrics(tmp_path):
    gw, reg, backend = make(tmp_path)
    chunks = run(gw, GatewayRequest("k-acme", 3, text="hi", adapter="support"))
    assert chunks[-1].final and backend.calls == [("base", "support")]
    assert reg.value("gateway_adapter_requests_total", tenant="acme", model="base", adapter="support",
                     outcome="success") == 1
    assert reg.value("gateway_adapter_output_tokens_total", tenant="acme", model="base", adapter="support") == 3


def test_an_adapter_name_as_the_model_name_runs_that_adapter_on_its_base_model(tmp_path):
    gw, _, backend = make(tmp_path)
    req = GatewayRequest("k-acme", 2, text="hi", model="support")
    chunks = run(gw, req)
    assert backend.calls == [("base", "support")] and chunks[-1].model_used == "base"
    assert req.adapter == "support"  # what the usage record names


def test_a_tenant_not_allowed_the_adapter_gets_permission_denied(tmp_path):
    gw, _, backend = make(tmp_path)
    for req in (GatewayRequest("k-acme", 2, text="hi", adapter="legal"),
                GatewayRequest("k-none", 2, text="hi", adapter="support")):
        err = refused(gw, req)
        assert err.kind == "permission_denied" and err.status == 403 and "adapter" in err.message
    # its name as the model name is a 404 like a name that exists nowhere: no oracle of others' adapters
    hidden = refused(gw, GatewayRequest("k-none", 2, text="hi", model="support"))
    unknown = refused(gw, GatewayRequest("k-none", 2, text="hi", model="nothing"))
    assert (hidden.kind, hidden.status) == (unknown.kind, unknown.status) == ("not_found", 404)
    assert hidden.message.replace("support", "X") == unknown.message.replace("nothing", "X")
    assert backend.calls == []


def test_an_unknown_adapter_is_not_found_naming_it(tmp_path):
    gw, _, backend = make(tmp_path)
    err = refused(gw, GatewayRequest("k-wild", 2, text="hi", adapter="nope"))
    assert (err.kind, err.status, err.field) == ("not_found", 404, "adapter")
    assert "'nope'" in err.message and "support" in err.message
    err = refused(gw, GatewayRequest("k-wild", 2, text="hi", model="nope"))  # neither model nor adapter
    assert err.kind == "not_found" and "'nope'" in err.message
    # an engine that declares no adapter folder never answers an adapter request with its base model
    err = refused(gw, GatewayRequest("k-wild", 2, text="hi", model="other", adapter="support"))
    assert err.kind == "not_found" and "'other'" in err.message
    assert backend.calls == []


def test_models_lists_the_adapters_the_tenant_may_use_under_their_base_model(tmp_path):
    gw, _, _ = make(tmp_path)
    ids = lambda key: {m["id"]: m.get("parent") for m in asyncio.run(gw.models(key))}  # noqa: E731
    assert ids("k-acme") == {"base": None, "other": None, "auto": None, "support": "base"}
    assert ids("k-wild") == {"base": None, "other": None, "auto": None, "support": "base", "legal": "base"}
    assert "support" not in ids("k-none")


def test_engine_limits_read_the_adapter_folder_from_the_rendered_config(tmp_path):
    folder = adapter_dir(tmp_path / "loras", "a", "b")
    (tmp_path / "tensorrt_llm").mkdir()
    (tmp_path / "tensorrt_llm" / "config.pbtxt").write_text(
        f'parameters {{ key: "lora_dir" value: {{ string_value: "{folder}" }} }}\n')
    (tmp_path / "gpu").mkdir()
    (tmp_path / "gpu" / "config.pbtxt").write_text('parameters { key: "gpt_model_path" value: { string_value: "" } }\n')
    limits = RepositoryEngineLimits(tmp_path, lora_dir=str(tmp_path / "loras"))
    assert limits("tensorrt_llm").adapters() == ["a", "b"]
    assert limits("gpu").adapters() == ["a", "b"]  # the gateway's own lora_dir, for an engine with no such key
    assert RepositoryEngineLimits(tmp_path)("gpu").adapters() is None


# -- the engine tensors -----------------------------------------------------------------------------------
class FakePb:
    class Tensor:
        def __init__(self, name, array):
            self.n, self.a = name, np.asarray(array)

        def name(self):
            return self.n


def test_lora_task_id_always_and_trtllm_weights_only_until_the_engine_holds_them(tmp_path):
    folder = adapter_dir(tmp_path / "loras", "support", "plain")
    weights = np.arange(12, dtype=np.float16).reshape(2, 6)
    config = np.array([[1, 0, 2], [3, 0, 2]], np.int32)
    np.save(folder / "support" / "model.lora_weights.npy", weights[None])  # hf_lora_convert.py keeps a batch dim
    np.save(folder / "support" / "model.lora_config.npy", config[None])
    reg = MemoryRegistry()
    backend = TritonBackend(FakePb, engine_limits=lambda m: EngineLimits(lora_dir=str(folder)),
                            metrics=GatewayMetrics(reg))
    sent = lambda adapter, reason: reg.value("gateway_lora_weights_sent_total", model="m",  # noqa: E731
                                             adapter=adapter, reason=reason)
    assert backend.lora_inputs("m", None) == []
    plain = backend.lora_inputs("m", "plain")  # the CPU engine's folders: PEFT only, the task id is enough
    assert [(t.n, t.a.dtype, t.a.tolist()) for t in plain] == [("lora_task_id", np.uint64, [[task_id("plain")]])]
    first = {t.n: t.a for t in backend.lora_inputs("m", "support")}
    assert set(first) == {"lora_task_id", "lora_weights", "lora_config"}
    assert first["lora_weights"].dtype == np.float16 and first["lora_weights"].shape == (1, 2, 6)
    assert first["lora_config"].tolist() == [config.tolist()]
    assert (sent("support", "first_use"), sent("plain", "first_use")) == (1, 0)  # weights sent, a task id is not
    backend.lora_sent.add(("m", "support"))
    assert [t.n for t in backend.lora_inputs("m", "support")] == ["lora_task_id"]
    backend.adapter_lost("m", "support")  # the engine said it no longer holds them
    assert [t.n for t in backend.lora_inputs("m", "support")][1:] == ["lora_weights", "lora_config"]
    assert (sent("support", "first_use"), sent("support", "evicted")) == (1, 1)
    assert [t.n for t in backend.lora_inputs("m", "support")][1:] == ["lora_weights", "lora_config"]
    assert (sent("support", "first_use"), sent("support", "evicted")) == (2, 1)  # sent before the engine answered
    assert json.dumps(task_id("support")) and task_id("support") < 2 ** 63


# -- leases: the front streams an adapter's requests itself, and hands back what needs the weights --------
FRONT_KEY = "fk-launcher"


class LeaseBackend(RecordingBackend):
    """RecordingBackend with the lease side of TritonBackend: its engine_call (the real one), and a LoRA
    cache note as TritonBackend keeps it (`sent`: what the engine has had the weights of)."""
    engine_call = TritonBackend.engine_call
    engine_values = staticmethod(TritonBackend.engine_values)
    vocab_size = 256

    def __init__(self):
        super().__init__()
        self.sent, self.lost = set(), []

    def engine_identity(self, model):
        return None

    def needs_weights(self, model, adapter):
        return (model, adapter) not in self.sent

    def adapter_lost(self, model, adapter):
        self.lost.append((model, adapter))
        self.sent.discard((model, adapter))

    async def engine_stream(self, model, req, prep, tenant):
        async for step in super().engine_stream(model, req, prep, tenant):
            yield step
        self.sent.add((model, req.adapter))


def lease_gateway(tmp_path):
    from gateway.tenants import hash_key

    cfg = parse_config(gateway_config(
        [Tenant("acme", allowed_adapters=("support",), limits={"max_concurrent": 8}),
         Tenant("wild", allowed_adapters=("*",))], models={"base": 4096}, default_model="base"))
    folder = adapter_dir(tmp_path / "loras", "support", "legal")
    records, backend, reg = [], LeaseBackend(), MemoryRegistry()
    gw = Gateway(lambda: cfg, MemoryLimiter(), Admission(16, 16, 1.0), GatewayMetrics(reg), backend,
                 Detokenizer([bytes([i]) for i in range(256)]),
                 engine_limits=lambda m: EngineLimits(lora_dir=str(folder)),
                 front_key_sha256=hash_key(FRONT_KEY), ledger=type("L", (), {"append": lambda self, r: records.append(
                     json.loads(r))})())
    return gw, backend, records, reg


def admit(gw, key, **kw):
    return asyncio.run(gw.leases.operation("admit", GatewayRequest(key, 3, text="hi", front_key=FRONT_KEY, **kw)))


def test_an_adapters_lease_carries_its_task_id_once_the_engine_holds_it_and_hands_back_until_then(tmp_path):
    gw, backend, _, _ = lease_gateway(tmp_path)
    first = admit(gw, "k-acme", model="support")  # the adapter's name as the model: resolved at the admit
    assert first["hand_back"] is True and first["model"] == "base" and "inputs" not in first
    assert gw.leases.live[first["lease"]].admitted.req.adapter == "support"
    backend.sent.add(("base", "support"))
    second = admit(gw, "k-acme", adapter="support")
    assert "hand_back" not in second and second["inputs"]["lora_task_id"] == [[task_id("support")]]
    assert "lora_task_id" not in admit(gw, "k-acme")["inputs"]  # no adapter, no task id
    with pytest.raises(ServingError) as e:  # the ACL at the admit, as on the gateway's stream
        admit(gw, "k-acme", adapter="legal")
    assert e.value.kind == "permission_denied"


def resume(gw, lease_id, key="k-acme", front_key=FRONT_KEY, stream=True):
    req = GatewayRequest(key, 3, text="hi", stream=stream, front_key=front_key, lease={"resume": lease_id})
    return run(gw, req)


def test_a_handed_back_lease_streams_through_the_gateway_as_one_request_settled_once(tmp_path):
    gw, backend, records, reg = lease_gateway(tmp_path)
    backend.sent.add(("base", "support"))  # the gateway's note says the engine has it
    grant = admit(gw, "k-acme", adapter="support")
    assert "hand_back" not in grant and "lora_task_id" in grant["inputs"]
    assert gw.limiter.reserved.get("acme", 0) > 0 and gw.admission.slots("base").inflight == 1
    chunks = resume(gw, grant["lease"])  # the engine said it does not hold it
    assert "".join(c.text for c in chunks) == "abc" and chunks[-1].final and chunks[-1].num_output_tokens == 3
    assert [c.text for c in chunks[:-1]] == ["a", "b", "c"]  # streamed, as the resume asked
    assert backend.lost == [("base", "support")] and backend.calls == [("base", "support")]
    assert grant["lease"] not in gw.leases.live  # no expiry settles it again
    assert gw.limiter.reserved.get("acme", 0) == 0 and gw.admission.slots("base").inflight == 0
    assert [(r["request_id"], r["adapter"], r["outcome"], r["completion_tokens"]) for r in records] == \
        [(grant["lease"], "support", "success", 3)]
    assert reg.value("gateway_adapter_requests_total", tenant="acme", model="base",
                                      adapter="support", outcome="success") == 1
    with pytest.raises(ServingError) as e:  # resumed once: the lease is the gateway stream's now
        resume(gw, grant["lease"])
    assert e.value.kind == "not_found"


def test_a_lease_granted_to_be_handed_back_is_no_eviction(tmp_path):
    gw, backend, records, _ = lease_gateway(tmp_path)
    grant = admit(gw, "k-acme", adapter="support")  # the engine never had the weights from here
    assert grant["hand_back"]
    assert "".join(c.text for c in resume(gw, grant["lease"])) == "abc"
    assert backend.lost == [] and backend.calls == [("base", "support")] and len(records) == 1


def test_only_the_front_resumes_only_its_tenants_adapter_lease(tmp_path):
    gw, backend, records, _ = lease_gateway(tmp_path)
    grant = admit(gw, "k-acme", adapter="support")
    plain = admit(gw, "k-acme")
    for key, front_key, kind in (("k-acme", None, "permission_denied"), ("k-acme", "fk-guess", "permission_denied"),
                                 ("k-wild", FRONT_KEY, "not_found")):
        with pytest.raises(ServingError) as e:
            resume(gw, grant["lease"], key, front_key)
        assert e.value.kind == kind, (key, front_key)
    with pytest.raises(ServingError) as e:
        resume(gw, plain["lease"])
    assert (e.value.kind, e.value.field) == ("invalid_argument", "lease")
    assert grant["lease"] in gw.leases.live and backend.calls == [] and records == []
