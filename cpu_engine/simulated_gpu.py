"""A simulated GPU engine: a test double of an H100 serving an 8B model with TensorRT-LLM, for capacity
benchmarks of the layers around the engine (Triton, the gateway, postprocessing, the front), which a real
GPU would otherwise need. It does no math.

It has `LLMEngine`'s API, so the same Triton adapter (model_repository/tensorrt_llm/1/model.py) serves it
under the `tensorrt_llm` contract: streaming and not, `stop`, cancellation, exclude_input_in_output,
perf outputs and the `nv_trt_llm_*` metrics. Its clock is an inflight-batching engine's: one iteration
every `itl_ms`, in which every running sequence gets one token, and a new request's first token at the
first iteration `ttft_ms` after it arrived; at most `max_batch_size` sequences run, the rest wait.
Tokens are deterministic: a fixed English text's ids, cycled, so detokenizing costs what real text costs.
Every request produces exactly `max_new_tokens` tokens (finish_reason `length`): sampling knobs, stop and
bad words, seeds and LoRA ids are accepted and have no effect. With `sim_lora_cache` > 0 it keeps
TensorRT-LLM's LoRA cache rule (what the paths around the engine must handle, and no CPU engine does): a
`lora_task_id` whose weights it does not hold, sent without `lora_weights`, is refused with TensorRT-LLM's
"not found in cache" error; one sent with them is held, the least recently used of more than
`sim_lora_cache` that no request in flight uses evicted, and when every one held is in use, the new one is
refused with TensorRT-LLM's "Cache is full" error. Both errors go out in TensorRT-LLM's own words, without
the project's error prefix, as the tensorrtllm backend sends them. Rendered with `simulated_engine=true`
(docs/benchmarks.md, Capacity); never the default.
"""
from __future__ import annotations

import threading
import time
from collections import OrderedDict, deque
from dataclasses import dataclass

from contracts.errors import LORA_CACHE_FULL, LORA_NOT_CACHED
from cpu_engine.sequence import PERF_FIELDS, RequestOutput

TEXT = ("The river runs past the old mill, where the miller's children watch the boats go by and count "
        "the swallows that nest under the bridge. In the evening the lamps are lit one by one along the "
        "quay, and the smell of bread drifts out of the bakery on the corner. ")
CANCEL_POLL_S = 0.1  # how often a running sequence's is_cancelled is asked (an IPC round trip each)


@dataclass
class SimulatedGpuConfig:
    ttft_ms: float = 30.0  # arrival to first token (a short prompt's prefill)
    itl_ms: float = 10.0  # between tokens of a stream: one iteration of the batch
    max_batch_size: int = 256  # sequences running at once; others wait
    max_seq_len: int = 8192
    lora_cache: int = 0  # adapters held as TensorRT-LLM's LoRA cache holds them; 0: task ids taken as they come

    @classmethod
    def from_parameters(cls, p: dict) -> "SimulatedGpuConfig":
        return cls(ttft_ms=float(p.get("sim_ttft_ms") or cls.ttft_ms), itl_ms=float(p.get("sim_itl_ms") or cls.itl_ms),
                   max_batch_size=int(p.get("max_engine_batch_size") or cls.max_batch_size),
                   max_seq_len=int(p.get("max_seq_len") or cls.max_seq_len),
                   lora_cache=int(p.get("sim_lora_cache") or cls.lora_cache))

    def __post_init__(self):
        if self.ttft_ms < 0 or self.itl_ms <= 0 or self.max_batch_size < 1 or self.lora_cache < 0:
            raise ValueError(f"simulated engine: sim_ttft_ms >= 0, sim_itl_ms > 0, max_engine_batch_size >= 1 and "
                             f"sim_lora_cache >= 0, got {self.ttft_ms}, {self.itl_ms}, {self.max_batch_size}, "
                             f"{self.lora_cache}")


class TrtllmError(Exception):
    """An error the tensorrtllm backend sends in TensorRT-LLM's own words (no error-contract prefix)."""


class LoraNotCachedError(TrtllmError):
    """The refusal of a task id whose weights the LoRA cache does not hold."""


class LoraCacheFullError(TrtllmError):
    """The refusal of an adapter's weights when every adapter the LoRA cache holds is in use."""


class _Stream:
    __slots__ = ("request_id", "prompt_len", "max_new", "on_output", "is_cancelled", "arrival_ns", "due",
                 "produced", "next_poll", "first_token_ns", "lora_task_id")

    def __init__(self, request_id, prompt_len, max_new, on_output, is_cancelled, due, lora_task_id=None):
        self.request_id, self.prompt_len, self.max_new = request_id, prompt_len, max_new
        self.on_output, self.is_cancelled, self.due = on_output, is_cancelled, due
        self.arrival_ns, self.produced, self.next_poll, self.first_token_ns = time.time_ns(), 0, due, 0
        self.lora_task_id = lora_task_id  # held in the LoRA cache while the stream runs


class SimulatedGpuEngine:
    def __init__(self, config: SimulatedGpuConfig, tokenizer=None):
        self.config = config
        ids = tokenizer.encode(TEXT, add_special_tokens=False).ids if tokenizer is not None else []
        self.tokens = ids or list(range(1000, 1064))
        self.waiting: deque[_Stream] = deque()
        self.running: list[_Stream] = []
        self._inbox: deque[_Stream] = deque()
        self._cancels: deque[str] = deque()
        self._wake = threading.Event()
        self._running = False
        self._thread: threading.Thread | None = None
        self.iteration = 0
        self.completed = 0
        self.lora_held: OrderedDict[int, int] = OrderedDict()  # its LoRA cache: task id -> streams using it,
        # least recently used first
        self._lora_lock = threading.Lock()  # submits come from the stub's threads

    def describe(self) -> str:
        c = self.config
        return (f"SIMULATED GPU engine (a test double, no model): first token after {c.ttft_ms:g} ms, "
                f"{c.itl_ms:g} ms between tokens, {c.max_batch_size} sequences at once")

    # -- API (any thread), as LLMEngine's ----------------------------------------------------------
    def submit(self, request_id: str, prompt_ids, params, on_output, is_cancelled=None, cache_salt=None,
               adapter=None, lora_task_id=None, lookahead=None, retention=None, lora_weights=False) -> None:
        from cpu_engine.engine import InvalidRequestError, check_max_seq_len
        from cpu_engine.speculation import LOOKAHEAD_INPUTS, request_lookahead

        # it simulates plain decoding only: a speculating (w, n, g) is refused as by an engine without lookahead
        for field, message in request_lookahead(None, *((lookahead or {}).get(n) for n in LOOKAHEAD_INPUTS))[1]:
            raise InvalidRequestError(field, message)

        if len(prompt_ids) == 0:
            raise InvalidRequestError("input_ids", "the prompt is empty")
        check_max_seq_len(len(prompt_ids), params.max_new_tokens, self.config.max_seq_len)
        for name in ("num_return_sequences", "return_log_probs", "return_context_logits", "return_generation_logits"):
            if getattr(params, name) not in (1, False):  # a timing double has no distribution to report
                raise InvalidRequestError(name, "is not supported by the simulated engine (benchmarks only)")
        held = lora_task_id if lora_task_id is not None and self.config.lora_cache else None
        if held is not None:
            self._lora(held, lora_weights)
        due = time.monotonic() + self.config.ttft_ms / 1000.0
        self._inbox.append(_Stream(request_id, len(prompt_ids), params.max_new_tokens, on_output, is_cancelled, due,
                                   held))
        self._wake.set()

    def _lora(self, task_id: int, weights: bool) -> None:
        """Holds `task_id` in the LoRA cache for one more stream, or refuses the request as TensorRT-LLM does."""
        with self._lora_lock:
            held = self.lora_held
            if task_id in held:
                held.move_to_end(task_id)
            elif not weights:
                raise LoraNotCachedError(f"LoRA task {task_id} {LORA_NOT_CACHED}. Please send LoRA weights with "
                                         "request")
            else:
                if len(held) >= self.config.lora_cache:
                    done = next((t for t, streams in held.items() if not streams), None)
                    if done is None:
                        raise LoraCacheFullError(LORA_CACHE_FULL)
                    del held[done]
                held[task_id] = 0
            held[task_id] += 1

    def _lora_done(self, task_id: int) -> None:
        with self._lora_lock:
            if self.lora_held.get(task_id):
                self.lora_held[task_id] -= 1

    def cancel(self, request_id: str) -> None:
        self._cancels.append(request_id)
        self._wake.set()

    def has_work(self) -> bool:
        return bool(self.running or self.waiting or self._inbox)

    def start(self) -> None:
        self._running = True
        self._thread = threading.Thread(target=self._loop, name="simulated-gpu-engine", daemon=True)
        self._thread.start()

    def shutdown(self) -> None:
        self._running = False
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        for s in list(self.running) + list(self.waiting) + list(self._inbox):
            self._finish(s, "cancelled")

    def stats(self) -> dict:
        return {"active_requests": len(self.running) + len(self.waiting), "max_requests": self.config.max_batch_size,
                "scheduled_requests": len(self.running), "context_requests": 0,
                "waiting_requests": len(self.waiting) + len(self._inbox), "generation_requests": len(self.running),
                "iteration_counter": self.iteration, "timestamp_us": time.time_ns() // 1000,
                "weight_dtype": "simulated", "weight_bits": 0}

    # -- the loop: one iteration per itl_ms ----------------------------------------------------------
    def _loop(self) -> None:
        period = self.config.itl_ms / 1000.0
        next_step = time.monotonic()
        while self._running:
            if not self.has_work():
                self._wake.wait()
                self._wake.clear()
                next_step = time.monotonic()
                continue
            self.step()
            next_step = max(next_step + period, time.monotonic() - period)  # no catch-up burst after a stall
            delay = next_step - time.monotonic()
            if delay > 0:
                time.sleep(delay)

    def step(self) -> None:
        """Admit, cancel, then one token to every running sequence whose first token is due."""
        while self._inbox:
            self.waiting.append(self._inbox.popleft())
        cancels = set()
        while self._cancels:
            cancels.add(self._cancels.popleft())
        now = time.monotonic()
        while self.waiting and len(self.running) < self.config.max_batch_size:
            self.running.append(self.waiting.popleft())
        self.iteration += 1
        keep = []
        for s in self.running:
            if s.request_id in cancels or (now >= s.next_poll and self._cancelled(s)):
                self._finish(s, "cancelled")
                continue
            if now >= s.next_poll:
                s.next_poll = now + CANCEL_POLL_S
            if now < s.due:
                keep.append(s)
                continue
            token = self.tokens[s.produced % len(self.tokens)]
            s.produced += 1
            if s.produced == 1:
                s.first_token_ns = time.time_ns()
            done = s.produced >= s.max_new
            if not self._deliver(s, [token], done, "length" if done else None) and not done:
                self._finish(s, "cancelled")  # as LLMEngine: a callback that raises ends its own request
            elif done:
                self.completed += 1
            else:
                keep.append(s)
        self.running = keep
        for s in [w for w in self.waiting if w.request_id in cancels]:
            self.waiting.remove(s)
            self._finish(s, "cancelled")

    def _cancelled(self, s: _Stream) -> bool:
        try:
            return s.is_cancelled is not None and bool(s.is_cancelled())
        except Exception:
            return False

    def _finish(self, s: _Stream, reason: str) -> None:
        self._deliver(s, [], True, reason)

    def _deliver(self, s: _Stream, tokens: list[int], finished: bool, reason: str | None) -> bool:
        if finished and s.lora_task_id is not None:
            self._lora_done(s.lora_task_id)
        now = time.time_ns()
        perf = dict.fromkeys(PERF_FIELDS, 0) | {"arrival_time_ns": s.arrival_ns, "first_scheduled_time_ns": s.arrival_ns,
                                                "first_token_time_ns": s.first_token_ns, "last_token_time_ns": now}
        out = RequestOutput(s.request_id, tokens, None, 0.0, finished, reason, None, s.prompt_len, s.produced, perf,
                            request_finished=finished)
        try:
            s.on_output(out)
            return True
        except Exception:
            return False
