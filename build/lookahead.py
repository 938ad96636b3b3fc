"""Speculative decoding on the GPU path: TensorRT-LLM 1.1.0's lookahead decoding.

Lookahead is the method the C++ runtime (the `tensorrtllm` Triton backend) runs with FP8 weights and an
FP8 paged KV cache and without a second model (build/upstream/tensorrt_llm_backend.json,
`speculative_decoding`: FP16 / BF16 / FP8, paged KV, inflight batching). It is set in three places
that must agree, each decided here once:
- the engine: `trtllm-build --speculative_decoding_mode lookahead_decoding --max_draft_len D`, with
  D = max_draft_len(W, N, G) (`build_flags`);
- the server: the model's `decoding_mode lookahead` and `lookahead_window_size` / `_ngram_size` /
  `_verification_set_size` = (W, N, G) (`server_values`, checked against the engine by `check`);
- each request: `lookahead_*` inputs (w, n, g) <= (W, N, G), sent by the gateway per tenant.
"""
from __future__ import annotations

KEYS = ("lookahead_window_size", "lookahead_ngram_size", "lookahead_verification_set_size")
MINIMUM = (1, 2, 1)  # upstream's meaningful minimum is (2, 2, 1); (1, 1, 0) is plain decoding


def max_draft_len(w: int, n: int, g: int) -> int:
    """The engine's --max_draft_len for a lookahead config (W, N, G), upstream's formula."""
    return (0 if n == 1 else n - 2) + (w - 1 + g) * (n - 1)


def parse(text: str) -> tuple[int, int, int]:
    """'W,N,G' -> (W, N, G); ValueError naming what is wrong."""
    try:
        values = tuple(int(v) for v in str(text).split(","))
    except ValueError:
        values = ()
    if len(values) != 3 or any(v < low for v, low in zip(values, MINIMUM)):
        raise ValueError(f"lookahead must be W,N,G with W >= 1, N >= 2, G >= 1 (e.g. 4,4,4), got {text!r}")
    return values


def build_flags(config: tuple[int, int, int] | None) -> list[str]:
    """trtllm-build's flags for an engine that runs lookahead (W, N, G); none for a plain engine."""
    if config is None:
        return []
    return ["--speculative_decoding_mode", "lookahead_decoding", "--max_draft_len", str(max_draft_len(*config))]


def server_values(config: tuple[int, int, int]) -> dict[str, str]:
    """The tensorrt_llm model parameters that serve an engine built for `config`."""
    return {"decoding_mode": "lookahead", **{k: str(v) for k, v in zip(KEYS, config)}}


def check(values: dict[str, str], engine_draft_len: int | None) -> None:
    """The rendered trtllm parameters against themselves and the engine's build_config.max_draft_len
    (None: not known). ValueError naming the knob when the server could not run what it declares."""
    mode = values.get("decoding_mode", "")
    set_keys = [k for k in KEYS if values.get(k, "") != ""]
    if mode == "draft_tokens_external":
        raise ValueError("decoding_mode draft_tokens_external is the CPU engine's draft model: TensorRT-LLM's "
                         "tensorrtllm backend takes no such decoding_mode (upstream runs draft-target through its "
                         "tensorrt_llm_bls model, which this repository does not render); use lookahead on the GPU")
    if mode != "lookahead":
        if engine_draft_len:
            raise ValueError(f"the engine was built with max_draft_len {engine_draft_len} (speculative decoding): "
                             "render it with decoding_mode=lookahead and its lookahead_* (W, N, G)")
        return
    if len(set_keys) != 3:
        raise ValueError("decoding_mode lookahead needs lookahead_window_size, lookahead_ngram_size and "
                         "lookahead_verification_set_size (W, N, G, the engine's build)")
    config = parse(",".join(values[k] for k in KEYS))
    if engine_draft_len is not None and max_draft_len(*config) != engine_draft_len:
        raise ValueError(f"lookahead (W, N, G) = {config} needs an engine built with max_draft_len "
                         f"{max_draft_len(*config)}; this one has {engine_draft_len}")
