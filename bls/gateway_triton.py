"""The gateway's backend inside Triton: BLS calls to `preprocessing` and the engine model.

`pb_utils` is passed in (its classes exist only once the stub runs). The engine is always asked to
stream, so the gateway sees every step and can stop the engine as soon as the client is gone.
"""
from __future__ import annotations

import asyncio

import numpy as np

from bls.cache_salt import tenant_cache_salt
from bls.contracts import ENGINE, PREPROCESSING
from bls.errors import ServingError, parse

_SAMPLING = {"temperature": "temperature", "top_k": "runtime_top_k", "top_p": "runtime_top_p",
             "seed": "seed", "min_tokens": "min_tokens"}


def _error(resp_error) -> ServingError:
    message = resp_error.message()
    return parse(message) or ServingError("internal", message)


class TritonBackend:
    def __init__(self, pb_utils):
        self.pb = pb_utils

    def _tensor(self, contract, name, value):
        spec = contract.input(name)
        return self.pb.Tensor(name, np.asarray(value, dtype=spec.numpy_dtype))

    async def tokenize(self, req) -> dict[str, np.ndarray]:
        inputs = [self._tensor(PREPROCESSING, "REQUEST_OUTPUT_LEN", [[req.max_tokens]])]
        if req.text is not None:
            inputs.append(self._tensor(PREPROCESSING, "QUERY", [[req.text]]))
        if req.messages is not None:
            inputs.append(self._tensor(PREPROCESSING, "MESSAGES", [[req.messages]]))
        for name, words in (("STOP_WORDS_DICT", req.stop_words), ("BAD_WORDS_DICT", req.bad_words)):
            if words:
                inputs.append(self._tensor(PREPROCESSING, name, [list(words)]))
        resp = await self.pb.InferenceRequest(
            model_name="preprocessing", inputs=inputs, requested_output_names=PREPROCESSING.output_names,
        ).async_exec()
        if resp.has_error():
            raise _error(resp.error())
        return {t.name(): t.as_numpy() for t in resp.output_tensors()}

    async def engine_stream(self, model: str, req, prep: dict, tenant: str):
        inputs = [
            self.pb.Tensor("input_ids", prep["INPUT_ID"].astype(np.int32)),
            self._tensor(ENGINE, "input_lengths", prep["REQUEST_INPUT_LEN"]),
            self._tensor(ENGINE, "request_output_len", prep["REQUEST_OUTPUT_LEN"]),
            # ignore_eos: an end id no token has (TensorRT-LLM's convention for forced lengths)
            self._tensor(ENGINE, "end_id", [[-1]] if req.ignore_eos else prep["OUT_END_ID"]),
            self._tensor(ENGINE, "pad_id", prep["OUT_PAD_ID"]),
            self.pb.Tensor("stop_words_list", prep["STOP_WORDS_IDS"].astype(np.int32)),
            self.pb.Tensor("bad_words_list", prep["BAD_WORDS_IDS"].astype(np.int32)),
            self._tensor(ENGINE, "streaming", [[True]]),
        ]
        for key, name in _SAMPLING.items():
            if req.sampling.get(key) is not None:
                inputs.append(self._tensor(ENGINE, name, [[req.sampling[key]]]))
        it = await self.pb.InferenceRequest(
            model_name=model, inputs=inputs, requested_output_names=["output_ids", "sequence_length"],
            request_id=req.request_id, parameters={"cache_salt": tenant_cache_salt(tenant)},
        ).async_exec(decoupled=True)
        loop = asyncio.get_running_loop()
        while True:
            # the iterator blocks: step it in a thread so other requests keep flowing (Triton 2.51)
            resp = await loop.run_in_executor(None, next, it, None)
            if resp is None:
                return
            if resp.has_error():
                raise _error(resp.error())
            out = self.pb.get_output_tensor_by_name(resp, "output_ids")
            if out is None:
                continue
            n = int(self.pb.get_output_tensor_by_name(resp, "sequence_length").as_numpy().reshape(-1)[0])
            yield out.as_numpy().reshape(-1)[:n].tolist()

    async def engine_stop(self, model: str, req) -> None:
        inputs = [self._tensor(ENGINE, "input_lengths", [[1]]), self._tensor(ENGINE, "request_output_len", [[1]]),
                  self.pb.Tensor("input_ids", np.zeros((1, 1), np.int32)), self._tensor(ENGINE, "stop", [[True]])]
        it = await self.pb.InferenceRequest(model_name=model, inputs=inputs, requested_output_names=[],
                                            request_id=req.request_id).async_exec(decoupled=True)
        loop = asyncio.get_running_loop()
        while await loop.run_in_executor(None, next, it, None) is not None:
            pass
