"""gateway: an async, decoupled BLS adapter over `gateway.core.Gateway`."""
import asyncio
import contextlib
import functools
import gc
import logging
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import triton_python_backend_utils as pb_utils

from contracts import triton_io as io
from gateway.admission import Admission
from gateway.batch_gate import BatchGate
from gateway.engine_stream import StubProcesses
from contracts.tensors import GATEWAY
from text.detokenize import Detokenizer
from gateway.engine_limits import RepositoryEngineLimits, preprocessing_max_output_len
from contracts.errors import to_triton_error
from gateway.core import Gateway
from gateway.metrics import AppliedInBackground, GatewayMetrics, GcPauses, LoopCpu, TritonRegistry
from gateway.lease_socket import LeaseSocket
from gateway.request import grouped_admits, parse_gateway_request
from gateway.triton_backend import TritonBackend
from gateway.ratelimit import MemoryLimiter, RedisLimiter
from gateway.kv_store import kv_store
from gateway.response_cache import ResponseCache
from gateway.sessions import Sessions
from gateway.tenants import ConfigWatcher
from text.tokenization import TokenizerBundle
from gateway.tenants import hash_key
from ledger.spool import SpoolWriter

log = logging.getLogger("gateway")
# how often a stream asks whether its client went away: each ask blocks the event loop that serves every
# stream for an IPC round trip (contracts/triton_io.CancelPoll); a cancelled stream stops the engine
# within this plus a step
CANCEL_POLL_S = 0.2


class TritonPythonModel:
    def initialize(self, args):
        p = io.model_parameters(args)
        self.metric_updates = AppliedInBackground(TritonRegistry(pb_utils))
        # Send() is a blocking IPC round trip that releases the GIL: from threads, the loop goes on meanwhile
        threads = int(p.get("response_threads") or 0)
        self.responders = ThreadPoolExecutor(threads, thread_name_prefix="gateway-respond") if threads else None
        metrics = GatewayMetrics(self.metric_updates)
        self.loop_cpu, self.loop_tasks = LoopCpu(metrics), None
        watcher = ConfigWatcher(p["gateway_config"], on_error=lambda e: log.error("gateway config: %s", e))
        if p.get("redis_url"):
            policy = p.get("fail_policy", "fail_open")
            limiter = RedisLimiter(p["redis_url"], policy, on_backend=lambda up: metrics.backend_up(up, policy))
        else:
            limiter = MemoryLimiter()
        detok = Detokenizer.from_tokenizer(TokenizerBundle.load(p["tokenizer_dir"]).tokenizer)
        repository = Path(args["model_repository"]).parent  # the engine models' configs sit next to ours
        engine_limits = RepositoryEngineLimits(repository, p.get("lora_dir"))
        admission = Admission(int(p["max_inflight"]), int(p["max_queue"]), float(p["max_queue_wait_s"]),
                              engine_limits=engine_limits)
        backend = TritonBackend(pb_utils, identity=StubProcesses(repository),
                                max_starting=int(p.get("max_starting_streams") or 0) or None,
                                engine_limits=engine_limits, vocab_size=detok.vocab_size,
                                max_output_len=preprocessing_max_output_len(repository), metrics=metrics)
        # the usage ledger: one JSON line per request into the launcher's spool (docs/usage.md)
        data_dir = os.environ.get("LLM_DATA_DIR")
        self.spool = SpoolWriter(Path(data_dir) / "spool") if data_dir else None
        worker_key = os.environ.get("LLM_BATCH_WORKER_KEY")
        # response cache and sessions: in Redis when configured (shared by replicas), else in this process
        kept = kv_store(p.get("redis_url"))
        front_key = os.environ.get("LLM_FRONT_KEY")  # the launcher's: the front's leases (docs/gateway.md)
        self.gateway = Gateway(watcher.get, limiter, admission, metrics, backend, detok,
                               engine_limits=engine_limits, ledger=self.spool,
                               worker_key_sha256=hash_key(worker_key) if worker_key else None,
                               front_key_sha256=hash_key(front_key) if front_key else None,
                               lease_ttl_s=float(p.get("lease_ttl_s") or 60),
                               response_cache=ResponseCache(kept, metrics), sessions=Sessions(kept),
                               batch_gate=BatchGate(int(p.get("batch_inflight_when_busy") or 0),
                                                    float(p["max_queue_wait_s"])))
        # the front's lease operations on a socket of their own (the launcher's LLM_GATEWAY_SOCKET), served by
        # the event loop that exists from the first request on (the front uses Triton until it is there)
        socket_path = os.environ.get("LLM_GATEWAY_SOCKET")
        self.lease_socket = LeaseSocket(socket_path, self.gateway) if socket_path else None
        # what was built to serve leaves the cyclic collector's reach: a full pass walks what requests made
        # since, and the event loop that admits and settles every request stalls for that, not the whole heap
        gc.collect()
        gc.freeze()
        self.gc_pauses = GcPauses(metrics)  # the passes from here on, serving

    def finalize(self):
        self.metric_updates.flush()
        if self.responders is not None:
            self.responders.shutdown(wait=True)
        if self.spool is not None:
            self.spool.close()

    async def execute(self, requests):
        if self.loop_tasks is None:  # the stub's event loop runs from the first request on
            self.loop_tasks = [asyncio.ensure_future(self.loop_cpu.run()), asyncio.ensure_future(self.gc_pauses.run())]
            if self.lease_socket is not None:
                try:
                    await self.lease_socket.start()
                except OSError as e:  # the front goes on through Triton
                    log.error("the lease socket %s cannot be opened: %s", self.lease_socket.path, e)
        await asyncio.gather(*(self._serve(r) for r in requests))
        return None

    async def _serve(self, request):
        final = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
        sender = request.get_response_sender()
        try:
            x = io.inputs(request, GATEWAY)
            req, operation = parse_gateway_request(x, io.request_parameters(request))  # 400s name the field
            if operation != "generate":
                # closed even when a send fails: a grouped admit's admits still waiting leave the admission queue
                answers = self.gateway.answers(operation, req, x.get("token_ids"), grouped_admits)
                async with contextlib.aclosing(answers):
                    async for out, last in answers:
                        response = pb_utils.InferenceResponse([pb_utils.Tensor(k, _array(k, v)) for k, v in out.items()])
                        if self.responders is None or not last:
                            sender.send(response, flags=final if last else 0)
                        else:  # the last response: those before it are sent already
                            await asyncio.get_running_loop().run_in_executor(
                                self.responders, functools.partial(sender.send, response, flags=final))
                return
            # the engine request id stays the gateway's own uuid: a client-chosen id could collide with
            # another tenant's, and the engine's `stop` cancels by id
            ended = False
            async for chunk in self.gateway.handle(req, io.CancelPoll(sender.is_cancelled, CANCEL_POLL_S)):
                out = {"text_output": [[chunk.text.encode()]]}
                if chunk.model_used:
                    out["model_used"] = [[chunk.model_used.encode()]]
                if chunk.token_logprobs:  # a token-level request (n > 1, log probs, echo)
                    out |= {"sequence_index": [[chunk.sequence_index]],
                            "token_logprobs": [[chunk.token_logprobs.encode()]]}
                if chunk.finish_reason:  # the request's (final), or one sequence's end (token-level)
                    out["finish_reason"] = [[chunk.finish_reason.encode()]]
                if chunk.final:
                    out |= {"model_used": [[chunk.model_used.encode()]],
                            "num_input_tokens": [[chunk.num_input_tokens]], "num_output_tokens": [[chunk.num_output_tokens]]}
                tensors = [pb_utils.Tensor(k, _array(k, v)) for k, v in out.items()]
                sender.send(pb_utils.InferenceResponse(tensors), flags=final if chunk.final else 0)
                ended = chunk.final
            if not ended:
                # a cancelled stream yields no final chunk; Triton counts a request without its final flag
                # as in flight, and would wait for it at unload (shutdown) until its exit timeout
                sender.send(flags=final)
        except Exception as e:
            sender.send(pb_utils.InferenceResponse(error=to_triton_error(pb_utils, e)), flags=final)


def _array(name, value):
    return np.array(value, dtype=GATEWAY.output(name).numpy_dtype)
