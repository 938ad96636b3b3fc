"""CPU engine: paged KV cache, inflight batching, chunked prefill and prefix reuse, in numpy.

Modules: config (knobs), checkpoint (HF folder -> weights), llama (model math), block_pool and
kv_cache_manager (paged KV), sequence (request state), scheduler (policies), sampler, engine (loop),
metrics (TensorRT-LLM metric names).
"""
from cpu_engine.config import ConfigError, EngineConfig
from cpu_engine.engine import InvalidRequestError, LLMEngine
from cpu_engine.scheduler import QueueFullError
from cpu_engine.sequence import RequestOutput, SamplingParams

__all__ = ["ConfigError", "EngineConfig", "InvalidRequestError", "LLMEngine", "QueueFullError",
           "RequestOutput", "SamplingParams"]
