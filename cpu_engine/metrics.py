"""Engine stats -> the TensorRT-LLM backend's metric families and labels, so one dashboard serves
the CPU engine and the `tensorrtllm` backend alike (custom_metrics_reporter.cc names)."""
from __future__ import annotations

FAMILIES = {
    "nv_trt_llm_request_metrics": ("TRT LLM request metrics", "request_type", {
        "active": "active_requests", "max": "max_requests", "scheduled": "scheduled_requests",
        "context": "context_requests", "waiting": "waiting_requests"}),
    "nv_trt_llm_kv_cache_block_metrics": ("TRT LLM KV cache block metrics", "kv_cache_block_type", {
        "max": "max_blocks", "free": "free_blocks", "used": "used_blocks", "tokens_per": "tokens_per_block",
        "reused": "reused_blocks", "fraction": "fraction_used"}),
    "nv_trt_llm_inflight_batcher_metrics": ("TRT LLM inflight batcher metrics", "inflight_batcher_specific_metric", {
        "total_context_tokens": "total_context_tokens", "generation_requests": "generation_requests",
        "micro_batch_id": None, "paused_requests": "paused_requests"}),
    "nv_trt_llm_general_metrics": ("General TRT LLM metrics", "general_type", {
        "timestamp": "timestamp_us", "iteration_counter": "iteration_counter"}),
}
# speculative decoding, named after TensorRT-LLM's IterationStats.specDecodingStats fields (the Triton
# backend's reporter exports no family for them): the last step's, plus running totals whose ratio is the
# acceptance rate (the per-request outputs total_draft_tokens / total_accepted_draft_tokens summed)
SPEC_DECODING_FAMILY = {
    "nv_trt_llm_spec_decoding_metrics": ("TRT LLM speculative decoding metrics", "spec_decoding_metric", {
        "num_draft_tokens": "draft_tokens", "num_accepted_tokens": "accepted_draft_tokens",
        "num_requests_with_draft_tokens": "requests_with_draft_tokens", "acceptance_length": "acceptance_length",
        "total_draft_tokens": "total_draft_tokens", "total_accepted_draft_tokens": "total_accepted_draft_tokens"}),
}


# the CPU engine's LoRA pool (cpu_engine/lora.py): no TensorRT-LLM family exists for it
LORA_FAMILIES = {
    "cpu_engine_lora_metrics": ("CPU engine LoRA adapter pool", "lora_metric", {
        "loaded": "lora_adapters_loaded", "max": "lora_max_adapters", "loads": "lora_loads",
        "evictions": "lora_evictions"}),
}
LORA_REQUESTS = ("cpu_engine_lora_requests", "Requests per LoRA adapter since the engine started", "adapter")
# the host KV tier (host_tier.py, kv_cache_host_memory_bytes): TensorRT-LLM's block metrics have no host-tier values
HOST_TIER_FAMILIES = {
    "cpu_engine_kv_host_tier_metrics": ("CPU engine host KV tier (evicted prefix blocks kept as float16)",
                                        "host_tier_metric", {
        "blocks": "host_blocks", "bytes": "host_bytes", "max_bytes": "host_max_bytes",
        "offloaded": "host_offloaded_blocks", "onboarded": "host_onboarded_blocks"}),
}
# the precision the engine runs its matmuls in: int8 has 7-bit weights where the CPU's integer GEMM needs
# them to stay exact, and int8 becomes float32 where no width is exact (onnx_graphs.int8_weight_limit)
WEIGHT_BITS = ("cpu_engine_weight_bits", "Bits per weight of the engine's matmuls, by weight_dtype", "weight_dtype")


def metric_samples(stats: dict) -> list[tuple[str, str, str, str, float]]:
    """[(family, description, label name, label value, value)] for every gauge."""
    out = []
    families = FAMILIES | (LORA_FAMILIES if "lora_adapters_loaded" in stats else {}) \
        | (SPEC_DECODING_FAMILY if "total_draft_tokens" in stats else {}) \
        | (HOST_TIER_FAMILIES if "host_blocks" in stats else {})
    for family, (description, label, mapping) in families.items():
        for value_label, key in mapping.items():
            out.append((family, description, label, value_label, float(stats.get(key, 0) if key else 0)))
    for adapter, n in sorted(stats.get("lora_requests", {}).items()):
        out.append((*LORA_REQUESTS, adapter, float(n)))
    if "weight_bits" in stats:
        out.append((*WEIGHT_BITS, stats["weight_dtype"], float(stats["weight_bits"])))
    return out
