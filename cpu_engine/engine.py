"""The engine loop: one thread, one ragged forward pass per step over every scheduled sequence.

`submit` and `cancel` may be called from any thread; they only touch an inbox. The loop thread owns
all other state: it drains the inbox, polls cancellation, schedules, runs the model, samples, and
frees finished sequences' blocks in the same step. Then it delivers the step's outputs (`on_output`
for each sequence that produced tokens or finished) and polls the running sequences' `is_cancelled`,
spread over `output_threads` and finished before the next step starts, so each request's outputs keep
their order. Every request settles exactly once (one output with `finished=True`).
"""
from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

from cpu_engine import blas, kernels
from cpu_engine.checkpoint import load_checkpoint
from cpu_engine.config import ConfigError, EngineConfig, available_memory_bytes, resolve_backends
from cpu_engine.draft_model import DraftModel, DraftModelError
from cpu_engine.guided import GuideCompiler, GuideError
from cpu_engine.block_pool import BlockPoolError
from cpu_engine.host_tier import HostTier
from cpu_engine.kv_cache_manager import KVCacheManager
from cpu_engine.llama import KVCache, LlamaModel
from cpu_engine.lora import AdapterLoadError, AdapterNotFoundError, LoraPool, StepLora
from cpu_engine.sampler import sample, stop_reason
from cpu_engine.scheduler import QueueFullError, Scheduler, SchedulerOutput
from cpu_engine.sequence import ENGINE_NAMES, RequestOutput, SamplingParams, Sequence, Status
from cpu_engine.speculation import LOOKAHEAD_INPUTS, NgramIndex, next_draft_len, request_lookahead
from cpu_engine.step_batch import ContextLogits, Sampler, pack_step

log = logging.getLogger("cpu_engine")
DRAFT_PENDING = -1  # a draft model's token not proposed yet (draft_model.DraftModel.fill writes it)


class InvalidRequestError(ValueError):
    """A request the engine refuses; `field` is the ensemble's input name, the message also names the
    engine tensor where it differs ("max_tokens (request_output_len): ...")."""

    def __init__(self, field: str, message: str):
        alias = ENGINE_NAMES.get(field)
        super().__init__(f"{field} ({alias}): {message}" if alias else f"{field}: {message}")
        self.field = field


def check_max_seq_len(prompt_tokens: int, max_new_tokens: int, max_seq_len: int) -> None:
    """The engine's own invariant that a sequence fits: prompt + max_new_tokens within max_seq_len, whoever
    sends the request (the gateway decides its own fit before admission: gateway/routing.py). The CPU engine
    and the simulated GPU refuse through this one check."""
    if prompt_tokens + max_new_tokens > max_seq_len:
        raise InvalidRequestError("max_tokens", f"prompt ({prompt_tokens} tokens) + max_tokens ({max_new_tokens}) "
                                  f"exceeds max_seq_len {max_seq_len}")


class LLMEngine:
    def __init__(self, config: EngineConfig, weights=None):
        self.config = config
        self.blas_core = blas.core_name()  # OpenBLAS kernel set (OPENBLAS_CORETYPE), see blas.py
        if config.num_threads:
            blas.set_num_threads(config.num_threads)
        resolved = resolve_backends(config.weight_dtype, config.matmul_backend, config.attention_backend)
        self.matmul_backend, self.attention_backend = resolved["matmul_backend"], resolved["attention_backend"]
        self.weights = weights if weights is not None else \
            load_checkpoint(config.checkpoint_dir, resolved["weight_dtype"])
        mc = self.weights.config
        if config.num_threads and self.weights.weight_dtype == "bfloat16":
            import torch

            torch.set_num_threads(config.num_threads)
        if config.num_threads and self.attention_backend == "numba":
            kernels.set_numba_threads(config.num_threads)
        self._wake = threading.Condition()
        # LoRA adapters (lora.py): loaded on first use off this loop; their requests wait in _lora_waiting
        self.loras = LoraPool(config.lora_dir, config.max_loras, config.max_lora_rank, mc, self._notify) \
            if config.lora_dir else None
        self._lora_waiting: list[Sequence] = []
        self._lora_seen = -1  # the pool version the last step looked at
        self._last_step_lora: StepLora | None = None  # reused while steps keep the same rows and adapters
        self.model = LlamaModel(self.weights, config.max_seq_len + 1, self.matmul_backend, self.attention_backend,
                                config.num_threads, release_numpy_copies=weights is None, lora=self.loras is not None)
        bs = config.tokens_per_block
        by_memory = int(available_memory_bytes() * config.kv_cache_free_mem_fraction) // mc.kv_bytes_per_token
        tokens = by_memory if config.max_tokens_in_paged_kv_cache is None \
            else min(by_memory, config.max_tokens_in_paged_kv_cache)
        self.num_blocks = max(1, tokens // bs)
        self.kv_cache = KVCache(mc.num_layers, self.num_blocks * bs, mc.num_kv_heads, mc.head_dim)
        self.kv_manager = KVCacheManager(self.num_blocks, bs, config.enable_kv_cache_reuse)
        if config.kv_cache_host_memory_bytes and config.enable_kv_cache_reuse:
            self.kv_manager.attach_host_tier(HostTier(config.kv_cache_host_memory_bytes), self.kv_cache)
        self.scheduler = Scheduler(config, self.kv_manager)
        self.draft_model = None
        if config.decoding_mode == "draft_tokens_external":
            try:
                self.draft_model = DraftModel(config.draft_model_dir or config.checkpoint_dir,
                                              resolve_backends(config.draft_weight_dtype, self.matmul_backend,
                                                               self.attention_backend)["weight_dtype"],
                                              mc.vocab_size, self.num_blocks * bs, config.max_seq_len + 1,
                                              config.max_num_tokens, self.matmul_backend, self.attention_backend,
                                              config.num_threads)
            except DraftModelError as e:
                raise ConfigError(str(e)) from None
        self.guides = GuideCompiler(Path(config.checkpoint_dir) / "tokenizer.json", mc.vocab_size)
        self.sequences: dict[str, Sequence] = {}
        self._inbox: deque = deque()
        self._cancels: deque = deque()
        self._thread: threading.Thread | None = None
        self._outbox: list[tuple[Sequence, RequestOutput]] = []  # this step's outputs, not yet delivered
        self._output_pool = ThreadPoolExecutor(config.output_threads - 1, thread_name_prefix="cpu-engine-output") \
            if config.output_threads > 1 else None
        self._running = False
        self.iteration = 0
        self.last_step = {"context_tokens": 0, "decode_requests": 0, "scheduled": 0, "context_requests": 0,
                          "draft_tokens": 0, "accepted_draft_tokens": 0, "requests_with_draft_tokens": 0}
        self.totals = {"prefill_tokens": 0, "decode_tokens": 0, "completed": 0, "cancelled": 0,
                       "draft_tokens": 0, "accepted_draft_tokens": 0}

    def describe(self) -> str:
        """What runs the matmuls, for the model's log."""
        draft = f"; {self.draft_model.describe()}" if self.draft_model is not None else ""
        return f"CPU engine, {self.weights.precision}{draft}"

    # -- API (any thread) -------------------------------------------------------------------------
    def submit(self, request_id: str, prompt_ids, params: SamplingParams, on_output,
               is_cancelled=None, cache_salt: str | None = None, adapter: str | None = None,
               lora_task_id: int | None = None, lookahead: dict | None = None, retention=None,
               lora_weights: bool = False) -> None:
        """`adapter` (a folder name of `lora_dir`) or `lora_task_id` (lora.task_id of one): run the request
        with that LoRA adapter; AdapterNotFoundError when there is none such. `lora_weights`: whether the
        request carried TensorRT-LLM's converted weights; ignored (this engine loads its `lora_dir` itself).
        `lookahead`: the request's lookahead inputs by name (speculation.LOOKAHEAD_INPUTS; absent ones take the
        engine's value).
        `retention`: retention.Retention, the eviction priorities of the request's KV blocks."""
        prompt, spec = self._checked(prompt_ids, params, lookahead)
        if adapter is not None or lora_task_id is not None:
            adapter = self._adapter(adapter, lora_task_id, params.num_return_sequences)
        n = params.num_return_sequences
        seq = Sequence(request_id, prompt, params, on_output, is_cancelled,
                       None if cache_salt is None else str(cache_salt), adapter, lookahead=spec, pending_forks=n - 1)
        seq.retention = retention
        if spec.speculates:
            if self.draft_model is None:
                seq.ngrams = NgramIndex(self.config.max_matching_ngram_size)
            seq.draft_len = spec.max_draft_len
        if params.guide is not None:
            try:
                seq.guide = self.guides.matcher(params.guide, params.end_id)
            except GuideError as e:
                raise InvalidRequestError(e.field, str(e)) from None
        with self._wake:
            if request_id in self.sequences:
                raise InvalidRequestError("request_id", f"{request_id!r} is already running")
            limit = self.config.max_queue_size
            if limit and len(self.scheduler.waiting) + len(self._inbox) >= limit:
                raise QueueFullError(f"queue full: {limit} requests waiting (max_queue_size={limit})")
            self.sequences[request_id] = seq
            self._inbox.append(seq)
            self._wake.notify()

    def cancel(self, request_id: str) -> None:
        with self._wake:
            self._cancels.append(request_id)
            self._wake.notify()

    def has_work(self) -> bool:
        return bool(self._inbox or self._cancels or self.scheduler.running or self.scheduler.waiting
                    or (self._lora_waiting and self.loras.version != self._lora_seen))

    def _notify(self) -> None:
        with self._wake:
            self._wake.notify()

    def start(self) -> None:
        self._running = True
        self._thread = threading.Thread(target=self._loop, name="cpu-engine", daemon=True)
        self._thread.start()

    def shutdown(self) -> None:
        with self._wake:
            self._running = False
            self._wake.notify()
        if self._thread:
            self._thread.join(timeout=30)
        if self._output_pool and not (self._thread and self._thread.is_alive()):  # a hung step still delivers
            self._output_pool.shutdown(wait=False)

    def _checked(self, prompt_ids, params: SamplingParams, lookahead: dict | None):
        """The engine's own invariants of a request, whoever sends it (the gateway, the ensemble, a direct
        Triton client): (prompt ids, its lookahead config), or InvalidRequestError naming the field."""
        prompt = [int(t) for t in prompt_ids]
        vocab = self.weights.config.vocab_size
        if not prompt:
            raise InvalidRequestError("input_ids", "the prompt is empty")
        if min(prompt) < 0 or max(prompt) >= vocab:
            raise InvalidRequestError("input_ids", f"token ids must be in [0, {vocab})")
        for field, message in params.problems():
            raise InvalidRequestError(field, message)
        la = lookahead or {}
        spec, problems = request_lookahead(self.config.lookahead, *(la.get(name) for name in LOOKAHEAD_INPUTS))
        for field, message in problems:
            raise InvalidRequestError(field, message)
        check_max_seq_len(len(prompt), params.max_new_tokens, self.config.max_seq_len)
        total = len(prompt) + params.max_new_tokens
        n = params.num_return_sequences
        own = self.kv_manager.blocks_for(total)
        if own + (n - 1) * (own - len(prompt) // self.config.tokens_per_block) > self.num_blocks:
            raise InvalidRequestError(
                "max_tokens", f"prompt ({len(prompt)} tokens) + max_tokens ({params.max_new_tokens})"
                f"{f' for {n} sequences' if n > 1 else ''} needs more KV cache than the whole cache holds "
                f"({self.num_blocks * self.config.tokens_per_block} tokens)")
        if params.embedding_bias is not None and len(params.embedding_bias) > vocab:
            raise InvalidRequestError("embedding_bias", f"must have at most one value per vocabulary entry "
                                                        f"({vocab}), got {len(params.embedding_bias)}")
        if not self.config.enable_chunked_context and len(prompt) > self.config.max_num_tokens:
            raise InvalidRequestError("input_ids", f"prompt longer than max_num_tokens {self.config.max_num_tokens} "
                                                   "and enable_chunked_context is off")
        return prompt, spec

    def _adapter(self, adapter: str | None, lora_task_id: int | None, n: int):
        """The loaded LoRA adapter a request names (by folder or task id); AdapterNotFoundError when none."""
        if n > 1:
            raise InvalidRequestError("num_return_sequences", "must be 1 with a LoRA adapter")
        if self.loras is None:
            raise AdapterNotFoundError(f"adapter {adapter or lora_task_id!r} not found: this engine serves no "
                                       "LoRA adapters (lora_dir is not set)")
        return self.loras.resolve(adapter, lora_task_id)

    def generate(self, prompt_ids, params: SamplingParams, cache_salt=None, adapter=None,
                 lookahead: dict | None = None) -> RequestOutput:
        """Blocking convenience for tests and benchmarks (drives `step` when no loop thread runs)."""
        done: list[RequestOutput] = []
        collected: list[int] = []
        lps: list[float] = []

        def on_output(out):  # the first sequence's (num_return_sequences > 1: submit and read them all)
            if out.sequence_index == 0:
                collected.extend(out.new_token_ids)
                lps.extend(out.new_log_probs or [])
                if out.finished:
                    done.append(out)

        rid = f"generate-{time.monotonic_ns()}"
        self.submit(rid, prompt_ids, params, on_output, cache_salt=cache_salt, adapter=adapter, lookahead=lookahead)
        while not done:
            if self._thread is None:
                self.step()
            else:
                time.sleep(0.002)
        out = done[0]
        out.new_token_ids, out.new_log_probs = collected, lps
        return out

    # -- the loop ---------------------------------------------------------------------------------
    def _loop(self) -> None:
        while True:
            with self._wake:
                while self._running and not self.has_work():
                    self._wake.wait()
                if not self._running:
                    break
            try:
                self.step()
            except Exception:  # a bug must not leave requests hanging: fail them all
                log.exception("engine step failed")
                for seq in list(self.scheduler.running) + list(self.scheduler.waiting) + self._lora_waiting:
                    self._finish(seq, "error", error="engine step failed (see server log)")
                self._deliver()
        for seq in list(self.sequences.values()):
            self._finish(seq, "cancelled")
        self._deliver()

    def step(self) -> None:
        """One iteration: take in what arrived (requests, stops), schedule, run the forward pass, sample and
        verify, deliver."""
        self._intake()
        self._deliver()
        self._propose_drafts()
        scheduled = self.scheduler.schedule()
        if not scheduled:
            return
        if self.draft_model is not None:
            self.draft_model.fill([c for c in scheduled.chunks if c.draft], self.kv_manager.slots)
        self.iteration += 1
        now = time.time_ns()
        for chunk in scheduled.chunks:
            chunk.seq.first_scheduled_time_ns = chunk.seq.first_scheduled_time_ns or now
        step = pack_step(scheduled.chunks, self.kv_manager.slots)
        step.batch.lora = self._step_lora(scheduled)
        logits = self.model.forward(step.batch, self.kv_cache)
        self._advance(scheduled, logits, step.contexts)
        spec = self._sample(step.samplers, logits)
        self._count(scheduled, step.batch, spec)
        self._deliver()

    def _intake(self) -> None:
        """New requests join the waiting queue (or the LoRA waiting room); requests found cancelled (`stop`,
        or `is_cancelled` when polled) leave and free their blocks."""
        with self._wake:
            new, self._inbox = list(self._inbox), deque()
            cancels, self._cancels = list(self._cancels), deque()
        for seq in new:
            if seq.adapter is None:
                self.scheduler.waiting.append(seq)
            else:
                self.loras.count_request(seq.adapter)
                self._lora_waiting.append(seq)
        for rid in cancels:
            seq = self.sequences.get(rid)
            for s in (seq.siblings or [seq]) if seq is not None else ():
                s.cancel_requested = True
        for seq in list(self.scheduler.running) + list(self.scheduler.waiting) + self._lora_waiting:
            polled, seq.cancel_polled = seq.cancel_polled, False
            if seq.cancel_requested or (not polled and _is_cancelled(seq)):
                self._finish(seq, "cancelled")
        if self._lora_waiting:
            self._admit_lora_waiting()

    def _advance(self, scheduled, logits, contexts: list[ContextLogits]) -> None:
        """After the forward pass: the positions computed (a draft's only once verified), full blocks
        registered for reuse, the prompt's logits kept where asked."""
        for chunk in scheduled.chunks:
            # a draft's K/V count only once verified: for now, its decode's last token alone
            chunk.seq.num_computed += chunk.num_tokens - len(chunk.draft)
            self.kv_manager.register_full_blocks(chunk.seq)
        for c in contexts:
            if c.seq.context_logits is None:
                c.seq.context_logits = np.empty((len(c.seq.prompt_ids), logits.shape[1]), np.float32)
            c.seq.context_logits[c.start:c.start + c.count] = logits[c.row:c.row + c.count]

    def _sample(self, samplers: list[Sampler], logits) -> dict:
        """Each scheduled request's next token (a speculating one row by row while its draft holds); a
        request's own failure ends it alone. -> this step's draft counts."""
        now = time.time_ns()
        spec = {"drafted": 0, "accepted": 0, "requests": 0}
        for sampler in samplers:
            seq, draft = sampler.seq, sampler.draft
            rows = logits[sampler.row:sampler.row + 1 + len(draft)]
            if seq.pending_forks:  # its prompt is computed: its other sequences start from here
                try:
                    forked = self._fork(seq)
                except BlockPoolError as e:
                    self._finish(seq, "error", error=f"num_return_sequences: {e}", error_kind="unavailable")
                    continue
            else:
                forked = [seq]
            for s in forked:
                try:
                    reason, accepted = self._sample_and_verify(s, draft, rows, now)
                except GuideError as e:  # the request's grammar, not the engine: the client's error, alone
                    self._finish(s, "error", error=f"{e.field}: {e}", error_kind="invalid_argument")
                    continue
                except Exception as e:  # one request's bad row ends that request alone; the batch goes on
                    log.exception("sampling %s failed", s.request_id)
                    self._finish(s, "error", error=f"sampling failed: {type(e).__name__}: {e}")
                    continue
                if draft:
                    spec["drafted"] += len(draft)
                    spec["accepted"] += accepted
                    spec["requests"] += 1
                if reason:
                    self._finish(s, reason)
                else:
                    self._emit(s, finished=False)
        return spec

    def _count(self, scheduled, batch, spec: dict) -> None:
        """This step's figures (`last_step`, `totals`): the engine's metrics read them."""
        verifying = [c for c in scheduled.chunks if c.draft]  # each is one decode request over several rows
        # by shape: a prompt's last single token counts as a decode
        decodes = len(batch.decode_rows) - sum(c.num_tokens for c in verifying) + len(verifying)
        self.last_step = {
            "context_tokens": sum(c.num_tokens for c in scheduled.chunks) - len(batch.decode_rows),
            "decode_requests": decodes,
            "scheduled": len(scheduled.chunks),
            "context_requests": len(scheduled.chunks) - decodes,
            "draft_tokens": spec["drafted"],
            "accepted_draft_tokens": spec["accepted"],
            "requests_with_draft_tokens": spec["requests"],
        }
        self.totals["prefill_tokens"] += self.last_step["context_tokens"]
        self.totals["decode_tokens"] += decodes
        self.totals["draft_tokens"] += spec["drafted"]
        self.totals["accepted_draft_tokens"] += spec["accepted"]

    def _propose_drafts(self) -> None:
        """Drafts for the running decodes that speculate (the scheduler may shorten them): prompt lookup's
        now, a draft model's as placeholders of the length it may have, filled once scheduled (their
        blocks are granted by then). A draft never runs past max_new_tokens: its tokens and the one sampled
        after them must fit, so the blocks a draft takes stay within what the request was admitted for.
        A draft model drafts only while at most `draft_model_max_batch_size` requests decode: a bigger step
        is compute-bound, and each draft pass then costs more than its tokens save."""
        limit = self.config.draft_model_max_batch_size
        drafting = self.draft_model is None or not limit or \
            sum(not s.in_prefill for s in self.scheduler.running) <= limit
        for seq in self.scheduler.running:
            seq.draft = []
            if not seq.lookahead.speculates or seq.in_prefill or not drafting:
                continue
            room = min(seq.draft_len, seq.params.max_new_tokens - len(seq.output_ids) - 1)
            seq.draft = seq.ngrams.propose(seq.all_ids, room) if seq.ngrams is not None else [DRAFT_PENDING] * room

    def _sample_and_verify(self, seq: Sequence, draft: list[int], rows: np.ndarray, now: int):
        """Sample from row 0; while the token drawn equals the draft's next token, that draft token stands
        and the next row (computed with it as input) is sampled too. -> (why the sequence ends or None,
        draft tokens accepted). Then the K/V of the accepted tokens count as computed and the blocks that
        only rejected drafts wrote go back to the pool."""
        accepted, reason = 0, None
        for i in range(len(rows)):
            token, lp = sample(seq, rows[i])
            reason = self._append(seq, token, lp, now, rows[i])
            if reason or i == len(draft) or token != draft[i]:
                break
            accepted += 1
        if draft:
            seq.draft_len = next_draft_len(len(draft), accepted, seq.draft_len, seq.lookahead.max_draft_len)
            seq.draft_tokens += len(draft)
            seq.accepted_draft_tokens += accepted
            seq.num_computed += accepted
            seq.draft_computed = min(seq.draft_computed, seq.num_computed)  # the draft model's K/V still valid
            self.kv_manager.register_full_blocks(seq)
            if not reason:
                self.kv_manager.truncate(seq, seq.num_tokens)
        return reason, accepted

    def _admit_lora_waiting(self) -> None:
        """Requests whose adapter is loaded join the scheduler's queue (in arrival order); a failed load
        fails its requests with the loader's message; the others go on waiting."""
        self._lora_seen = self.loras.version
        still = []
        for seq in list(self._lora_waiting):
            try:
                seq.lora = self.loras.acquire(seq.adapter)
            except (AdapterLoadError, AdapterNotFoundError) as e:
                self._finish(seq, "error", error=str(e), error_kind="invalid_argument"
                             if isinstance(e, AdapterLoadError) else "not_found")
                continue
            if seq.lora is None:
                still.append(seq)
            else:
                self.scheduler.waiting.append(seq)
        self._lora_waiting = still
        self.loras.forget_failures()

    def _fork(self, seq: Sequence) -> list[Sequence]:
        """Sequences 1..n-1 of a request whose first sequence has just computed its prompt: each shares the
        prompt's full KV blocks and gets a copy of its partial last block, then samples on its own from
        the same logits (its own generator). Returns every sequence of the request, the first one first."""
        n, seq.pending_forks = seq.pending_forks + 1, 0
        free = self.kv_manager.pool.num_free
        if len(seq.prompt_ids) % self.config.tokens_per_block and free < n - 1:
            raise BlockPoolError(f"{n - 1} free KV blocks needed to fork {n} sequences, {free} free")
        child_params = dataclasses.replace(seq.params, num_return_sequences=1, return_context_logits=False)
        seq.siblings = [seq]
        for i in range(1, n):
            child = Sequence(f"{seq.request_id}#{i}", seq.prompt_ids, child_params, seq.on_output, seq.is_cancelled,
                             seq.cache_salt, None, sequence_index=i, siblings=seq.siblings, status=Status.RUNNING,
                             arrival_time_ns=seq.arrival_time_ns, first_scheduled_time_ns=seq.first_scheduled_time_ns,
                             lookahead=seq.lookahead, draft_len=seq.draft_len)
            child.retention = seq.retention  # its generated blocks keep the request's decode priority
            if seq.ngrams is not None:  # speculation: its own n-gram index over its own tokens
                child.ngrams = NgramIndex(self.config.max_matching_ngram_size)
            if seq.guide is not None:  # its own grammar state, at the start as the parent's is
                child.guide = self.guides.matcher(seq.params.guide, seq.params.end_id)
            copy = self.kv_manager.fork(seq, child)
            if copy is not None:
                bs = self.config.tokens_per_block
                src = seq.block_table[len(child.block_table) - 1] * bs  # the parent's partial block
                self.kv_cache.k[:, copy * bs:(copy + 1) * bs] = self.kv_cache.k[:, src:src + bs]
                self.kv_cache.v[:, copy * bs:(copy + 1) * bs] = self.kv_cache.v[:, src:src + bs]
            with self._wake:
                self.sequences[child.request_id] = child
            self.scheduler.running.append(child)
            seq.siblings.append(child)
        return seq.siblings

    def _append(self, seq: Sequence, token: int, lp: float, now: int, logits_row=None) -> str | None:
        """Record a sampled token; returns why the sequence ends, if it does."""
        if not 0 <= token < self.weights.config.vocab_size or not np.isfinite(lp):
            raise ValueError(f"sampler returned token {token} with log-prob {lp}")
        seq.output_ids.append(token)
        seq.cum_log_prob += lp
        if seq.guide is not None:
            seq.guide.accept(token)
        if not seq.first_token_time_ns:
            seq.first_token_time_ns = now
        seq.last_token_time_ns = now
        reason = stop_reason(seq)
        if reason != "end_id":  # like TensorRT-LLM, the end id is not part of the output
            seq.pending_ids.append(token)
            seq.pending_log_probs.append(lp)
            if seq.params.return_generation_logits:
                seq.pending_logits.append(np.array(logits_row, dtype=np.float32))
        return reason

    def _step_lora(self, scheduled: SchedulerOutput) -> StepLora | None:
        """The step's rows grouped by LoRA adapter (None: no adapter in the step); the last step's grouping
        is reused while the rows are the same."""
        groups: dict[str, tuple] = {}
        row = 0
        for chunk in scheduled.chunks:
            lora = chunk.seq.lora
            if lora is not None:
                groups.setdefault(lora.name, (lora, []))[1].extend(range(row, row + chunk.num_tokens))
            row += chunk.num_tokens
        if not groups:
            return None
        step_groups = [(a, np.asarray(rows, dtype=np.int64)) for _, (a, rows) in sorted(groups.items())]
        last = self._last_step_lora
        if last is None or not last.same_rows(step_groups, row):
            last = self._last_step_lora = StepLora(step_groups, row, self.loras.stacks,
                                                   int8=self.weights.weight_dtype == "int8")
        return last

    def _emit(self, seq: Sequence, finished: bool, reason=None, error=None, error_kind=None) -> None:
        if not finished and not seq.pending_ids:
            return
        context = None
        if seq.context_logits is not None and not seq.context_logits_sent and seq.output_ids:  # prompt done
            context, seq.context_logits_sent = seq.context_logits, True
            seq.context_logits = None
        out = RequestOutput(
            request_id=seq.request_id,
            new_token_ids=seq.pending_ids,
            new_log_probs=seq.pending_log_probs if seq.params.return_log_probs else None,
            cum_log_prob=seq.cum_log_prob,
            finished=finished,
            finish_reason=reason,
            error=error,
            error_kind=error_kind,
            num_prompt_tokens=len(seq.prompt_ids),
            num_generated_tokens=len(seq.output_ids),
            perf=seq.perf(),
            sequence_index=seq.sequence_index,
            context_logits=context,
            generation_logits=seq.pending_logits if seq.params.return_generation_logits else None,
            # the whole request ends with this output: an error, a sequence that ends before its siblings
            # were forked, or the last of its sequences to finish
            request_finished=finished and (error is not None or seq.pending_forks > 0
                                           or all(s.status is Status.FINISHED for s in seq.siblings)),
        )
        seq.pending_ids, seq.pending_log_probs, seq.pending_logits = [], [], []
        self._outbox.append((seq, out))

    def _deliver(self) -> None:
        """Call `on_output` for the outputs of this step and, for each sequence that goes on, poll its
        `is_cancelled` (the next step's start acts on it). Under Triton both are blocking IPCs to the
        server (~0.2 ms a send, ~0.05 ms a poll, measured at 16 streams): spread over `output_threads`,
        the server handles them concurrently, where one thread leaves a core idle."""
        outbox, self._outbox = self._outbox, []
        if not outbox:
            return
        if self._output_pool is None or len(outbox) == 1:
            _deliver_all(outbox)
            return
        # a sequence may have several outputs in one step (its last tokens, then an error): they go
        # to one thread, in order, so that no final output overtakes a partial one of its request
        by_seq: dict[int, list] = {}
        for item in outbox:  # a request's n sequences too: its final output comes last
            seq = item[0]
            by_seq.setdefault(id(seq.siblings[0] if seq.siblings else seq), []).append(item)
        groups = list(by_seq.values())
        n = self.config.output_threads
        parts = [[item for g in groups[i::n] for item in g] for i in range(n)]
        futures = [self._output_pool.submit(_deliver_all, part) for part in parts[1:] if part]
        _deliver_all(parts[0])
        for f in futures:
            f.result()

    def _finish(self, seq: Sequence, reason: str, error: str | None = None, error_kind: str | None = None) -> None:
        if seq.status is Status.FINISHED:
            return
        self.scheduler.remove(seq)
        if seq in self._lora_waiting:
            self._lora_waiting.remove(seq)
        if seq.lora is not None:
            self.loras.release(seq.lora)
        if seq.block_table:
            self.kv_manager.release(seq)
        seq.status = Status.FINISHED
        with self._wake:
            self.sequences.pop(seq.request_id, None)
        self.totals["cancelled" if reason == "cancelled" else "completed"] += 1
        if error is not None:
            self._emit(seq, finished=False)  # tokens made before the error reach the client first
        self._emit(seq, finished=True, reason=reason, error=error, error_kind=error_kind)
        if error is not None:  # one failed sequence fails its request (its error ended it): the others stop
            for other in seq.siblings:
                self._finish(other, "cancelled")

    # -- observability ----------------------------------------------------------------------------
    def _host_stats(self) -> dict:
        host = self.kv_manager.host
        return {"host_blocks": len(host), "host_bytes": host.bytes, "host_max_bytes": host.capacity_bytes,
                "host_offloaded_blocks": host.offloaded_total, "host_onboarded_blocks": host.onboarded_total}

    def stats(self) -> dict:
        pool = self.kv_manager.pool
        return {
            "active_requests": len(self.scheduler.running) + len(self.scheduler.waiting),
            "max_requests": self.config.max_batch_size,
            "scheduled_requests": self.last_step["scheduled"],
            "context_requests": self.last_step["context_requests"],
            "waiting_requests": len(self.scheduler.waiting) + len(self._inbox),
            "max_blocks": pool.num_blocks,
            "free_blocks": pool.num_free,
            "used_blocks": pool.num_used,
            "tokens_per_block": self.config.tokens_per_block,
            "reused_blocks": pool.reused_total,
            "fraction_used": pool.num_used / pool.num_blocks,
            "total_context_tokens": self.last_step["context_tokens"],
            "generation_requests": self.last_step["decode_requests"],
            # list(): a copy taken under the GIL, since the loop thread may change the queue meanwhile
            "paused_requests": sum(1 for s in list(self.scheduler.waiting) if s.preemptions),
            "iteration_counter": self.iteration,
            "timestamp_us": time.time_ns() // 1000,
            "weight_dtype": self.weights.weight_dtype,
            "weight_bits": self.weights.weight_bits,
            **(self.loras.stats() if self.loras is not None else {}),
            **(self._spec_stats() if self.config.lookahead is not None else {}),
            **(self._host_stats() if self.kv_manager.host is not None else {}),
        }

    def _spec_stats(self) -> dict:
        """The last step's drafts (acceptance length: tokens per speculating request in it, as TensorRT-LLM
        defines it) and the totals since start."""
        step = self.last_step
        requests = step["requests_with_draft_tokens"]
        return {"draft_tokens": step["draft_tokens"], "accepted_draft_tokens": step["accepted_draft_tokens"],
                "requests_with_draft_tokens": requests,
                "acceptance_length": 1 + step["accepted_draft_tokens"] / requests if requests else 0.0,
                "total_draft_tokens": self.totals["draft_tokens"],
                "total_accepted_draft_tokens": self.totals["accepted_draft_tokens"]}


def _is_cancelled(seq: Sequence) -> bool:
    try:
        return seq.is_cancelled is not None and bool(seq.is_cancelled())
    except Exception:
        return False


def _deliver_all(outputs) -> None:
    for seq, out in outputs:
        try:
            seq.on_output(out)
        except Exception:
            log.exception("on_output of %s raised; cancelling it", seq.request_id)
            if not out.finished:
                seq.cancel_requested = True
        if not out.finished and not seq.cancel_requested and _is_cancelled(seq):
            seq.cancel_requested = True
        seq.cancel_polled = True


__all__ = ["LLMEngine", "InvalidRequestError", "QueueFullError", "SamplingParams", "RequestOutput",
           "AdapterNotFoundError", "AdapterLoadError"]
