"""The gateway's backend inside Triton: BLS calls to `preprocessing` and the engine model.

`pb_utils` is passed in (its classes exist only once the stub runs). The engine is always asked to
stream, so the gateway sees every step and can stop the engine as soon as the client is gone. Engine
responses are read on threads of the gateway's own, never on the event loop's shared executor, and no wait for
the engine is unbounded: a dead engine ends every stream with an `unavailable` error (gateway/engine_stream.py).
"""
from __future__ import annotations

import asyncio
import uuid

import numpy as np

from gateway.cache_salt import tenant_cache_salt
from gateway.engine_stream import END, BlockingStream, EngineWatch, StreamThreads
from gateway.edges import Preprocessed
from contracts.generation import STOP_REQUEST, EngineStep
from contracts.tensors import ENGINE, PREPROCESSING, lora_task_id
from contracts.errors import LORA_NOT_CACHED, ServingError, from_transport, invalid, parse
from text.preprocess import check_max_tokens



# what Triton says about an engine model that is dead, restarting or not loaded: try again shortly
_ENGINE_DOWN = ("is not healthy", "not ready", "unknown model", "unavailable model")


def retention_inputs(priority: int, duration_ms: int) -> dict:
    """The engine's retention inputs (TensorRT-LLM's names) for one priority over the whole prompt (0 to -1: its
    end) and the generated tokens, for `duration_ms`."""
    return {"retention_token_range_starts": [[0]], "retention_token_range_ends": [[-1]],
            "retention_token_range_priorities": [[priority]], "retention_token_range_durations_ms": [[duration_ms]],
            "retention_decode_priority": [[priority]], "retention_decode_duration_ms": [[duration_ms]]}


def _not_ready(model: str) -> ServingError:
    return ServingError("unavailable", f"engine model '{model}' is not ready: it is being loaded", retry_after=5.0)


def _error(resp_error) -> ServingError:
    message = resp_error.message()
    if parse(message) is None and any(s in message.lower() for s in _ENGINE_DOWN):
        return ServingError("unavailable", message, retry_after=5.0)
    return from_transport(message)  # the contract's prefix, or Triton's and TensorRT-LLM's own words


def _numpy(tensor):
    return None if tensor is None else tensor.as_numpy()


class TritonBackend:
    STOP_TIMEOUT_S = 2.0  # a `stop` the engine does not confirm in time is given up (the engine may be dead)
    # Triton's Python backend serves all of a stub's BLS calls *and* response sends from one pool of
    # threads in the server (32: `--backend-config=python,thread-pool-size`), and a decoupled BLS call
    # holds one until the child's first response. Engine streams still waiting for theirs (queued
    # behind a full KV cache) are therefore kept below the pool, or the gateway could not tokenize or
    # send anything: with 64 such streams a refusal took 4.5 s that the ensemble gave in 0.02 s.
    MAX_STARTING = 24

    def __init__(self, pb_utils, identity=None, max_starting: int | None = None, engine_limits=None,
                 vocab_size: int = 0, max_output_len: int | None = None, metrics=None):
        """`identity(model)`: the engine's process ids (gateway.engine_stream.StubProcesses), to tell a stream
        whose engine process died even after the launcher restarted it. `max_starting`: engine streams
        allowed to wait for their first response at once (MAX_STARTING). `max_output_len`: preprocessing's
        cap on max_tokens, which a prompt the front tokenized is held to as well (`prepared`). `metrics`
        (gateway.metrics.GatewayMetrics): counts the adapter weights sent, and why."""
        self.pb = pb_utils
        self.max_output_len = max_output_len
        self.vocab_size = vocab_size  # the dense embedding_bias of a logit_bias has one value per token
        self.watch = EngineWatch(self.engine_probe, identity)
        self.threads = StreamThreads(name="engine-stream")
        self.starting = asyncio.Semaphore(max_starting or self.MAX_STARTING)
        self.engine_limits = engine_limits  # model -> EngineLimits (where an engine's converted adapters are)
        self.lora_sent: set[tuple[str, str]] = set()  # (model, adapter) whose weights the engine has had
        self.lora_lost: set[tuple[str, str]] = set()  # ... that the engine said it no longer holds, not yet resent
        self.metrics = metrics

    def lora_inputs(self, model: str, adapter: str | None) -> list:
        """`lora_task_id` for an adapter, plus, where the engine takes TensorRT-LLM's converted weights
        (model.lora_weights.npy / model.lora_config.npy in its adapter folder), `lora_weights` and
        `lora_config` on the first request for it (or when the engine no longer holds them)."""
        if not adapter:
            return []
        inputs = [self._tensor(ENGINE, "lora_task_id", [[lora_task_id(adapter)]])]
        files = self._converted(model, adapter)
        if files is not None and (model, adapter) not in self.lora_sent:
            weights, config = (np.load(f) for f in files)
            self._weights_sent(model, adapter)
            inputs.append(self._tensor(ENGINE, "lora_weights", weights.reshape((1,) + weights.shape[-2:])))
            inputs.append(self._tensor(ENGINE, "lora_config", config.reshape((1,) + config.shape[-2:])))
        return inputs

    def _converted(self, model: str, adapter: str):
        return self.engine_limits(model).converted_lora(adapter) if self.engine_limits else None

    def _weights_sent(self, model: str, adapter: str) -> None:
        """Counted by why: a rate of `evicted` against the adapter requests says the engine's LoRA cache is
        smaller than the adapters in use (the LLMLoRACacheThrashing alert)."""
        reason = "evicted" if (model, adapter) in self.lora_lost else "first_use"
        self.lora_lost.discard((model, adapter))
        if self.metrics is not None:
            self.metrics.lora_weights_sent(model, adapter, reason)

    def needs_weights(self, model: str, adapter: str) -> bool:
        """Whether the engine takes `adapter` as TensorRT-LLM's converted weights and has not had them from
        here: only the gateway's own stream sends them (a lease's front is handed it back at once)."""
        return (model, adapter) not in self.lora_sent and self._converted(model, adapter) is not None

    def adapter_lost(self, model: str, adapter: str) -> None:
        """The engine said it does not hold `adapter` (a front's stream, Leases.resumed): send its weights
        with the next request for it."""
        self.lora_sent.discard((model, adapter))
        self.lora_lost.add((model, adapter))

    def _tensor(self, contract, name, value):
        spec = contract.input(name)
        return self.pb.Tensor(name, np.asarray(value, dtype=spec.numpy_dtype))

    def prepared(self, req) -> Preprocessed:
        """What the front's preprocessor made of a lease's prompt (GatewayRequest.prepared), held to what
        preprocessing would have checked beyond it: max_tokens within preprocessing's cap, and asked for."""
        check_max_tokens(req.max_tokens, self.max_output_len)
        if int(req.prepared.request_output_len.reshape(-1)[0]) != req.max_tokens:
            raise invalid("lease", "prep was made for another max_tokens")
        return req.prepared

    async def tokenize(self, req) -> Preprocessed:
        inputs = [self._tensor(PREPROCESSING, "REQUEST_OUTPUT_LEN", [[req.max_tokens]])]
        if req.text is not None:
            inputs.append(self._tensor(PREPROCESSING, "QUERY", [[req.text]]))
        if req.messages is not None:
            inputs.append(self._tensor(PREPROCESSING, "MESSAGES", [[req.messages]]))
        if req.tools is not None:
            inputs.append(self._tensor(PREPROCESSING, "TOOLS", [[req.tools]]))
        if req.prompt_ids is not None and req.text is None and req.messages is None:
            inputs.append(self._tensor(PREPROCESSING, "PROMPT_IDS", [req.prompt_ids]))
        for name, words in (("STOP_WORDS_DICT", req.stop_words), ("BAD_WORDS_DICT", req.bad_words)):
            if words:
                inputs.append(self._tensor(PREPROCESSING, name, [list(words)]))
        resp = await self.pb.InferenceRequest(
            model_name="preprocessing", inputs=inputs, requested_output_names=PREPROCESSING.output_names,
        ).async_exec()
        if resp.has_error():
            raise _error(resp.error())
        return Preprocessed.from_tensors({t.name(): t.as_numpy() for t in resp.output_tensors()})

    @staticmethod
    def engine_values(req, prep: Preprocessed, vocab_size: int = 0) -> dict[str, np.ndarray]:
        """The engine inputs of a generate request, typed as the engine contract says, streaming on."""
        values = {
            "input_ids": prep.input_ids, "input_lengths": prep.input_lengths,
            "request_output_len": prep.request_output_len,
            # ignore_eos: an end id no token has (TensorRT-LLM's convention for forced lengths)
            "end_id": [[-1]] if req.ignore_eos else prep.end_id, "pad_id": prep.pad_id,
            "stop_words_list": prep.stop_words, "bad_words_list": prep.bad_words, "streaming": [[True]],
            **{name: [[value]] for name, value in req.sampling.engine_inputs().items()},
            **(req.guide.engine_inputs() if req.guide is not None else {}),
            **{name: [[value]] for name, value in (req.lookahead or {}).items()},  # the tenant's (w, n, g)
            **req.outputs.engine_inputs(vocab_size),
            **(retention_inputs(*req.kv_retention) if req.kv_retention is not None else {}),
        }
        return {k: np.asarray(v, dtype=ENGINE.input(k).numpy_dtype) for k, v in values.items() if v is not None}

    def engine_call(self, model: str, req, prep: Preprocessed, tenant: str) -> dict:
        """What a front needs to stream from the engine itself (the gateway's Leases): the inputs as lists,
        the tenant's cache salt. A prompt the front tokenized (`req.prepared`) is not sent back: it has the ids."""
        values = self.engine_values(req, prep, self.vocab_size)
        if req.prepared is not None:
            del values["input_ids"]
        if req.adapter:  # the task id alone: an engine without the weights says so, and the front hands the
            # lease back to stream through the gateway, which sends them (Leases.resumed)
            values["lora_task_id"] = np.asarray([[lora_task_id(req.adapter)]], ENGINE.input("lora_task_id").numpy_dtype)
        return {"inputs": {k: v.tolist() for k, v in values.items()}, "cache_salt": tenant_cache_salt(tenant)}

    def engine_identity(self, model: str):
        return self.watch.begin(model)

    async def engine_alive(self, model: str, started_on) -> None:
        """Raises `unavailable` unless the engine a stream started on still runs and answers."""
        await self.watch.alive(model, started_on)

    async def engine_stream(self, model: str, req, prep: Preprocessed, tenant: str):
        inputs = [self.pb.Tensor(k, v) for k, v in self.engine_values(req, prep, self.vocab_size).items()]
        lora = self.lora_inputs(model, req.adapter)
        started_on = self.watch.begin(model)
        if not await self.engine_ready(model):
            # being reloaded (or not loaded): refused at once. Sent anyway, the request would fail with
            # "not ready", but Triton 2.51 can lose that error when several requests fail at once (their
            # responses share one id in the stub) and end a stream empty instead
            raise _not_ready(model)

        def make_request(lora_inputs):
            return self.pb.InferenceRequest(
                model_name=model, inputs=inputs + lora_inputs, requested_output_names=req.outputs.output_names(),
                request_id=req.request_id, parameters={"cache_salt": tenant_cache_salt(tenant)},
            )
        request = make_request(lora)
        await self.starting.acquire()  # released at the first response (see MAX_STARTING)
        starting, stream = True, None
        produced, last_had_output = False, False
        try:
            # not async_exec: it would hold a thread of the loop's shared executor until the first response
            stream = BlockingStream(lambda: request.exec(decoupled=True), self.threads)
            while True:
                # bounded: a dead (or restarted) engine raises `unavailable`
                resp = await self.watch.next(stream, model, started_on)
                if starting:
                    starting = False
                    self.starting.release()
                if resp is END:
                    # the engine's own last response carries outputs; an empty end (what Triton sends
                    # when the stub dies) or no output at all is a success only if the engine is alive
                    if not (produced and last_had_output):
                        await self.watch.verify(model, started_on)
                    return
                if resp.has_error():
                    if req.adapter and not produced and LORA_NOT_CACHED in resp.error().message() \
                            and len(lora) == 1:  # the engine lost the adapter: once more, with its weights
                        self.adapter_lost(model, req.adapter)
                        lora = self.lora_inputs(model, req.adapter)
                        if len(lora) > 1:
                            stream.close()
                            retry = make_request(lora)
                            stream = BlockingStream(lambda: retry.exec(decoupled=True), self.threads)
                            continue
                    raise _error(resp.error())
                if req.adapter and len(lora) > 1:
                    self.lora_sent.add((model, req.adapter))  # the engine holds it now: the task id will do
                step = EngineStep.from_outputs(lambda name: _numpy(self.pb.get_output_tensor_by_name(resp, name)))
                last_had_output = step is not None
                if step is None:
                    continue
                produced = produced or bool(step.ids)
                yield step
        finally:
            if starting:
                self.starting.release()
            if stream is not None:
                stream.close()

    async def _stop(self, model: str, request_id: str) -> None:
        """Send the engine `stop` for `request_id` and wait for its answer; raises the engine's error."""
        inputs = [self._tensor(ENGINE, name, value) for name, value in STOP_REQUEST.items()]
        request = self.pb.InferenceRequest(model_name=model, inputs=inputs, requested_output_names=[],
                                           request_id=request_id)
        stream = BlockingStream(lambda: request.exec(decoupled=True), self.threads)
        try:
            while (resp := await stream.next()) is not END:
                if resp.has_error():
                    raise _error(resp.error())
        finally:
            stream.close()

    async def engine_stop(self, model: str, req) -> None:
        try:
            await asyncio.wait_for(self._stop(model, req.request_id), self.STOP_TIMEOUT_S)
        except (Exception, asyncio.TimeoutError):
            pass  # nothing more to do: the stream is settled either way, and a dead engine runs nothing

    async def engine_probe(self, model: str) -> None:
        """Is the engine alive? Triton must call it ready, and a `stop` for an id no request has must
        answer: at once, with an empty final response; a dead Triton Python stub answers with an error
        ("Stub process ... is not healthy"). Readiness first: the stop's empty answer proves nothing of
        a model that is being reloaded, because a request to it may end empty too (see engine_stream)."""
        if not await self.engine_ready(model):
            raise _not_ready(model)
        await self._stop(model, f"probe-{uuid.uuid4().hex}")

    async def engine_ready(self, model: str) -> bool:
        """Triton's readiness of the engine model: false while the launcher reloads it (or after its load
        failed); true for a model whose stub died and that is not reloaded yet (Triton 2.51 does not
        notice a dead stub: the stream checks and the probe's `stop` do)."""
        try:
            return bool(await asyncio.get_running_loop().run_in_executor(None, self.pb.is_model_ready, model))
        except Exception:  # cannot tell: the engine's own answers decide
            return True
