"""Write docs/knobs.md from the knob tables themselves, so the documented defaults are the rendered ones.

    python build/knobs_doc.py            # rewrite docs/knobs.md
    python build/knobs_doc.py --check    # exit 1 if docs/knobs.md is not what this would write

Defaults come from `build/render.py` (`COMMON`, `TARGET_DEFAULTS`, which take the CPU engine's from
`cpu_engine/config.py`), the `max_seq_len` cap from `cpu_engine/hf_config.py`, the header-forward
pattern and admin header from `launcher/triton.py`. Only the meanings are written here; a knob the
renderer knows but this file does not describe fails the generation (tests/docs/test_knobs_doc.py).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from build import engine_admission, render  # noqa: E402
from cpu_engine.hf_config import MAX_SEQ_LEN_CAP  # noqa: E402
from build.triton_flags import ADMIN_HEADER, HEADER_FORWARD  # noqa: E402

DOC = ROOT / "docs" / "knobs.md"
HIDDEN = {"triton_backend"}  # fixed by the target, not a knob anyone sets

# knob -> default as words, for knobs whose default is derived when rendering
DERIVED = {
    "tokenizer_dir": "the HF checkpoint",
    "gpt_model_path": "the HF checkpoint",
    "max_seq_len": f"min(max_position_embeddings, {MAX_SEQ_LEN_CAP})",
    "max_output_len": "`max_seq_len`",
    "lora_dir": "`<checkpoint>-loras`",
    # from the engine served (build/engine_admission.py)
    "gateway_max_inflight": "`max_engine_batch_size` (CPU), the engine's `max_batch_size`, at most the sequences "
                            "its KV cache holds at `max_seq_len` (GPU)",
    "gateway_max_queue": f"{engine_admission.QUEUE_PER_SLOT} x `gateway_max_inflight`",
}

MEANINGS = {
    # both targets
    "triton_max_batch_size": "`max_batch_size` of every model (requests carry batch 1; the engine batches inflight)",
    "preprocessing_instance_count": "Python stub processes of `preprocessing` (each holds a tokenizer)",
    "postprocessing_instance_count": "Python stub processes of `postprocessing`",
    "decoupled_mode": "the engine streams; must stay true for `stream` / `generate_stream`",
    "engine_model_name": "name of the engine model (the ensemble and gateway call it)",
    "tokenizer_dir": "tokenizer.json + tokenizer_config.json (chat template)",
    "max_seq_len": "prompt + output tokens per request",
    "max_output_len": "cap on `max_tokens`",
    "skip_special_tokens": "postprocessing drops special tokens (`<|im_end|>`) from text",
    "batch_scheduler_policy": "or `max_utilization` (admit greedily, preempt the newest)",
    "enable_kv_cache_reuse": "prefix reuse of full KV blocks; off on the GPU because its backend ignores the "
                             "per-tenant cache salt ([gpu.md](gpu.md#tenant-isolation-of-the-prefix-cache))",
    "enable_chunked_context": "long prompts are prefilled in chunks between decode steps",
    "max_queue_size": "engine waiting queue bound; beyond it `queue_full` (503). GPU: rendered as "
                      "`dynamic_batching.default_queue_policy.max_queue_size`, where the C++ backend reads it",
    "max_tokens_in_paged_kv_cache": "KV cache size in tokens (min with the memory fraction)",
    "exclude_input_in_output": "responses carry only generated tokens (per-request input overrides)",
    "lora_dir": "folder of PEFT LoRA adapters, one folder per adapter; the CPU engine loads them and the "
                "gateway lists them",
    # CPU target
    "gpt_model_path": "folder the CPU engine loads (`config.json`, `*.safetensors`)",
    "max_num_tokens": "tokens per engine step (decode tokens + prefill chunks)",
    "tokens_per_block": "KV block size, also the prefix-reuse granularity",
    "kv_cache_free_mem_fraction": "fraction of available RAM the KV cache may take",
    "kv_cache_host_memory_bytes": "bytes of host memory for prefix blocks the KV pool evicts, copied back when the "
                                  "prefix returns (CPU engine: float16 copies, cpu_engine/host_tier.py; GPU: "
                                  "TensorRT-LLM's host KV offload); 0 or empty: off",
    "max_engine_batch_size": "sequences running at once",
    "stats_check_period_ms": "how often `nv_trt_llm_*` metrics refresh",
    "matmul_backend": "`onnxruntime` (MLAS, every weight packed once at load; faster matmuls for twice the weight "
                      "memory), `numpy` (OpenBLAS, repacks per call), `auto` (onnxruntime when installed); "
                      "[engine.md](engine.md#kernels)",
    "attention_backend": "`numba` (one parallel kernel per layer reads the paged cache in place), `numpy` (gather, "
                         "then batched matmuls), `auto` (numba when installed)",
    "stream_interval": "streaming: the first token is sent at once, then one response every N tokens (the final "
                       "response carries the rest); vLLM's knob of that name. Each response costs CPU in the "
                       "engine stub, the server, `postprocessing` and the client "
                       "([benchmarks.md](benchmarks.md) measures 1 against 2)",
    "output_threads": "threads that deliver each engine step's responses and then poll each running request's "
                      "cancellation, before the next step starts (each request's responses keep their order); "
                      "1: the engine loop does it all",
    "num_threads": "threads for OpenBLAS, MLAS, numba (and torch); set it when other processes share the cores",
    "weight_dtype": "`int8` (the layers' and the LM head's matmuls as integer GEMMs), `float32` (every step in "
                    "float32: batched outputs equal the one-sequence reference token for token), `bfloat16` "
                    "(torch/oneDNN matmuls for steps of 3+ rows; needs `make setup BF16=1`), `auto` (bf16 when torch "
                    "is installed and the CPU has AVX512-BF16/AMX, else int8 with onnxruntime, else float32); "
                    "speed and accuracy of each: [engine.md, Precision](engine.md#precision)",
    "decoding_mode": "`lookahead`: speculative decoding (CPU: prompt-lookup drafts verified in one step, "
                     "[engine.md](engine.md#speculative-decoding-cpu_enginespeculationpy); GPU: TensorRT-LLM's lookahead decoding, the engine "
                     "built for it, [gpu.md](gpu.md#speculative-decoding-lookahead)); `draft_tokens_external` (CPU "
                     "only): drafts from a draft model (`draft_model_dir`), verified the same way and switched per "
                     "request by the same lookahead inputs; empty: plain decoding",
    "lookahead_window_size": "W, the most a request may ask for as `lookahead_window_size` (GPU: the Jacobi "
                             "window; the CPU engine runs none)",
    "lookahead_ngram_size": "N, the most a request may ask for as `lookahead_ngram_size`: up to N - 1 draft tokens "
                            "verified per step",
    "lookahead_verification_set_size": "G, the most a request may ask for as `lookahead_verification_set_size` "
                                       "(candidates verified per step; the CPU engine verifies one)",
    "max_matching_ngram_size": "CPU: the longest tail of a sequence looked up in its prompt and output for a draft "
                               "(at least 2 tokens must match)",
    "max_draft_tokens_per_step": "CPU: draft tokens verified in one step, all requests together: a step stays "
                                 "memory-bound for a few dozen rows, past that drafts cost more than they save",
    "draft_model_dir": "CPU, `decoding_mode draft_tokens_external`: the draft model, a HF Llama checkpoint "
                       "folder with the engine's vocabulary (its K/V take a cache of its own beside the engine's); "
                       "empty: the engine's own checkpoint at `draft_weight_dtype`",
    "draft_weight_dtype": "CPU: the draft model's precision (`int8`, `float32`, `bfloat16`, `auto`): a float32 "
                          "engine drafted by its own int8 copy keeps float32's tokens at a cheaper step "
                          "([engine.md](engine.md#speculative-decoding-cpu_enginespeculationpy))",
    "draft_model_max_batch_size": "CPU: a draft model drafts only while at most this many requests decode (a "
                                  "bigger step is compute-bound and each draft pass costs more than it saves); "
                                  "0: at any batch",
    "decode_context_share_tokens": "CPU: while several tenants decode, each tenant's rows in a step hold at most "
                                   "this many context tokens (its longest-waiting row always runs; the others take "
                                   "turns), so one tenant's long streams cannot make every step slow for the rest; "
                                   "0: every row decodes every step",
    "max_loras": "LoRA adapters kept in memory at once (least recently used evicted)",
    "max_lora_rank": "adapters of a higher rank are refused at load",
    "simulated_engine": "`true`: a SIMULATED GPU engine (a test double, no model: deterministic tokens on an "
                        "H100's clock) in place of the CPU engine, for capacity benchmarks of the layers around "
                        "the engine ([benchmarks.md](benchmarks.md#capacity)); never for serving",
    "sim_ttft_ms": "simulated engine: arrival to first token",
    "sim_itl_ms": "simulated engine: time between a stream's tokens (one iteration of the whole batch)",
    "sim_lora_cache": "simulated engine: adapters its LoRA cache holds, refusing as TensorRT-LLM does a task id "
                      "sent without its weights (least recently used of those no request in flight uses "
                      "evicted) and new weights while every adapter held is in use; 0: task ids taken as they come",
    "engine_instance_count": "instances (stub processes) of the engine model; the CPU engine and the trtllm "
                             "backend run one, the simulated engine scales out with more",
    # gateway
    "gateway_config": "tiers, tenants (SHA-256 key digests), routing; reloaded on change",
    "gateway_redis_url": "`redis://host:port/db` to share rate-limit state between gateways; empty: in-process",
    "gateway_fail_policy": "when Redis is unreachable: `fail_open` (admit, unlimited) or `fail_closed` (reject, 503)",
    "gateway_max_inflight": "engine requests in flight per engine model before the admission queue holds them; "
                            "GPU: from the engine folder's `config.json` "
                            "(`--engine-dir`), without one the build default 64 with a warning "
                            "([gpu.md](gpu.md#admission-from-the-engine))",
    "gateway_max_queue": "admission queue bound (then `overloaded`)",
    "gateway_max_queue_wait_s": "longest wait in the admission queue (then `overloaded`)",
    "gateway_lease_ttl_s": "a lease (the front streaming from the engine itself) that its front does not renew "
                           "for this long is settled as cancelled with its reserved tokens charged: a front that "
                           "died holds nothing longer ([gateway.md](gateway.md#leases))",
    "gateway_response_threads": "0: the gateway's event loop sends each answer to a lease operation (admit, settle), "
                                "a blocking IPC round trip to tritonserver; n: n threads send them and the loop goes "
                                "on. On 2 cores no consistent difference (0.85-1.31x the requests/s); to be measured "
                                "where cores are spare "
                                "([benchmarks.md](benchmarks.md#on-16-cores-again-the-front-reading-the-engine-over-http-2026-11-27))",
    "gateway_batch_inflight_when_busy": "batch-tier requests (the Batch API's lines) per engine model while any "
                                        "interactive request is in flight there; 0: batch only on idle capacity "
                                        "([usage.md](usage.md))",
}


class UndocumentedKnob(Exception):
    pass


def shown(value: str | None, knob: str) -> str:
    if knob in DERIVED:
        return DERIVED[knob]
    if value == "":
        return "empty (all cores)" if knob == "num_threads" else "empty"
    path = Path(str(value))
    if path.is_absolute() and ROOT in path.parents:
        return f"`{path.relative_to(ROOT)}`"
    return str(value)


def default_of(knob: str) -> str:
    """The CPU default, and the GPU's where it differs (unset: the C++ backend's own)."""
    cpu = render.TARGET_DEFAULTS["cpu"].get(knob, render.COMMON.get(knob))
    gpu = render.TARGET_DEFAULTS["trtllm"].get(knob, render.COMMON.get(knob))
    if knob in render.COMMON and cpu != gpu:
        return f"{shown(cpu, knob)} (CPU), {shown(gpu, knob) if gpu != '' else 'unset'} (GPU)"
    return shown(cpu, knob)


def table(knobs: list[str]) -> str:
    missing = [k for k in knobs if k not in MEANINGS]
    if missing:
        raise UndocumentedKnob(f"describe these knobs in build/knobs_doc.py MEANINGS: {', '.join(missing)}")
    rows = ["| knob | default | meaning |", "|---|---|---|"]
    rows += [f"| `{k}` | {default_of(k)} | {MEANINGS[k]} |" for k in knobs]
    return "\n".join(rows)


def generate() -> str:
    common = [k for k in render.COMMON if not k.startswith("gateway_")]
    gateway = [k for k in render.COMMON if k.startswith("gateway_")]
    cpu = [k for k in render.TARGET_DEFAULTS["cpu"] if k not in HIDDEN and k not in render.COMMON]
    gpu = render.TARGET_DEFAULTS["trtllm"]
    n_upstream = len(render.ENGINE_PARAMETERS["trtllm"])
    return f"""# Knobs

<!-- generated by build/knobs_doc.py from build/render.py and cpu_engine/config.py: edit those, then run
     `python build/knobs_doc.py` (tests/docs/test_knobs_doc.py fails when this file is stale) -->

Set at render time: `python build/render.py --target cpu --set key=value ...` (or
`make serve RENDER_ARGS="--set key=value"`). Unknown knobs and unfilled placeholders fail the render;
every rendered `config.pbtxt` is parsed as a Triton `ModelConfig` before it is written. The defaults
live in `build/render.py` (`COMMON`, `TARGET_DEFAULTS`); the CPU engine's come from its own
`EngineConfig` (`cpu_engine/config.py`), so the repository and the engine cannot disagree.

## Both targets

{table(common)}

## CPU target (`--target cpu`, the default)

{table(cpu)}

## Gateway (both targets; [gateway.md](gateway.md))

{table(gateway)}

## TensorRT-LLM target (`--target trtllm`)

See [gpu.md](gpu.md) for the engine build and launch. Every key of upstream's `tensorrt_llm/config.pbtxt`
is a knob of the same name ({n_upstream}, listed with their upstream source in
`build/upstream/tensorrt_llm_backend.json`); empty means unset (the backend's default). Set here:
`gpt_model_path` (the engine folder inside the container, `{gpu['gpt_model_path']}`), `gpt_model_type`
({gpu['gpt_model_type']}), `kv_cache_free_gpu_mem_fraction` ({gpu['kv_cache_free_gpu_mem_fraction']}),
`max_beam_width` ({gpu['max_beam_width']}), `cancellation_check_period_ms`
({gpu['cancellation_check_period_ms']}) and `stats_check_period_ms` ({gpu['stats_check_period_ms']}),
`enable_kv_cache_reuse` ({gpu['enable_kv_cache_reuse']}), `guided_decoding_backend` ({gpu['guided_decoding_backend']}:
structured outputs and required tool calls; empty turns it off) with `xgrammar_tokenizer_info_path` (empty: the
tokenizer info rendered beside the engine's `config.pbtxt`, `{render.XGRAMMAR_INFO}`), `max_queue_delay_microseconds`
({gpu['max_queue_delay_microseconds']}, `dynamic_batching`), the data-type placeholders
(`encoder_input_features_data_type`, `logits_datatype`, `prompt_embedding_table_data_type`), and the fixed
`FORCE_CPU_ONLY_INPUT_TENSORS` ({gpu['FORCE_CPU_ONLY_INPUT_TENSORS']}) and `executor_worker_path`.
`--deploy docker|compose|k8s` renders the container paths of that deploy target (`build/deploy_targets.py`);
`--engine-dir` names the engine folder on this machine, whose `config.json` sets the gateway's admission
bounds (`--gpu-mem-gb`, default {engine_admission.H100_80GB_GB}: the GPU memory of its KV-cache bound;
[gpu.md](gpu.md#admission-from-the-engine)).

## Server (`make serve`, `python -m launcher`)

| make | flag | environment | default | what |
|---|---|---|---|---|
| `HOST` | `--host` | `FRONT_HOST` | 127.0.0.1 | the front's (public) address |
| `PORT` | `--port` | `FRONT_PORT` | 9000 | the front's port |
| | `--triton-host` | `TRITON_HOST` | 127.0.0.1 | Triton's internal address (never a public one) |
| `HTTP_PORT` | `--http-port` | `TRITON_HTTP_PORT` | 8000 | Triton HTTP (internal) |
| `GRPC_PORT` | `--grpc-port` | `TRITON_GRPC_PORT` | 8001 | Triton gRPC (internal; the front talks to it) |
| `METRICS_PORT` | `--metrics-port` | `TRITON_METRICS_PORT` | 8002 | Triton metrics (internal) |
| `SMALL_ENGINE` | render `--engine` | | `tensorrt_llm_small:max_seq_len=1024,max_num_tokens=128,max_tokens_in_paged_kv_cache=4096` | the demo config's degrade target, rendered beside the default engine (empty: the default engine alone; [gateway.md](gateway.md#routing)) |
| | `--front-metrics-port` | `FRONT_METRICS_PORT` | 9002 | the front's own metrics, on 127.0.0.1 |
| | `--drain-timeout-s` | | 30 | on stop, in-flight requests get this long at the front |
| | `--no-front` | | off | Triton only (internal use) |
| | `--log-verbose` | `TRITON_LOG_VERBOSE` | 0 | Triton's log level |
| | `--data-dir` | `LLM_DATA_DIR` | runtime/data | usage ledger (SQLite) and the gateway's usage spool ([usage.md](usage.md)) |
| | `--ledger-url` | `LLM_LEDGER_URL` | empty | `postgresql://...`: ledger and batches in PostgreSQL (replicas share it) |
| | `--front-workers` | `FRONT_WORKERS` | 1 | processes of the front on its one port (`python -m front --workers`): each streamed token costs CPU in the process that serves it, so the front scales out with cores; limits stay exact (they live in the gateway) |
| | `--no-engine-direct` | | off | every token through the gateway; by default the front streams from the engine itself and the gateway admits and settles each request with a lease ([gateway.md](gateway.md#leases-the-fronts-streams-do-not-cross-the-gateway)); the launcher gives the front and the gateway a new random `LLM_FRONT_KEY` for that at every start |
| | | `LLM_GATEWAY_SOCKET` | a new private folder's `gateway.sock` per start | the gateway's lease socket: the front's admits and settles on a Unix socket the gateway serves, past Triton (with `--engine-protocol http`; [gateway.md](gateway.md#the-lease-socket)); set but empty: none, every lease operation through Triton's HTTP |

`python -m launcher --help` is the authority for these. Headers matching `{HEADER_FORWARD}` are forwarded
into request parameters on HTTP `/infer` and gRPC (the gateway reads API keys from them). The launcher runs
Triton with `--model-control-mode=explicit --load-model=*` and `--disable-auto-complete-config` (every config
is complete; a Python model then loads with one stub, not a throwaway auto-complete stub first) and restricts
the repository, logging, trace and shared-memory APIs to a random admin key (header `{ADMIN_HEADER}`) that
only it holds; it uses that key to unload and load again a model whose stub died, and replaces tritonserver
when a load cannot finish or the server died (README, Security).

## Front (`python -m front`)

`--host`/`--port` (as above), `--triton-grpc` (127.0.0.1:8001), `--triton-http` / `FRONT_TRITON_HTTP` (127.0.0.1:8000),
`--engine-protocol` / `FRONT_ENGINE_PROTOCOL` (http; how the front reads the engine's token streams: Triton's HTTP
generate_stream over the front's own keep-alive connections, `front/engine_http.py`, or `grpc`, a tritonclient gRPC
stream, which costs the front about twice the CPU per token: `benchmarks/results/2026-11-27-front-engine-protocol.json`;
the gateway's lease operations go the same way, over http a quarter of the front's CPU per admit + settle:
`benchmarks/results/2026-11-27-lease-ops-http.json`; with `LLM_GATEWAY_SOCKET` set they go on the gateway's lease socket
once it is open: `benchmarks/results/2026-11-28-lease-socket-admission.json`),
`--tokenize-max-bytes` / `FRONT_TOKENIZE_MAX_BYTES` (4096; a streamed request's prompt up to this many characters, of a
key the gateway granted a lease in the last minute, is tokenized by the front itself and handed to the gateway with its
admission, others by `preprocessing`; 0: all by `preprocessing`; 1.20-1.71x the gateway's admissions a second on 2 cores:
`benchmarks/results/2026-11-27-front-tokenizes-prompts.json`),
`--token-lane` / `FRONT_TOKEN_LANE` (auto; each read of the engine's HTTP stream has its plain token events taken and
written to the client by the compiled lane, `front/token_lane.c`, which `make setup` builds, or by the Python path;
auto: the lane when built from the source beside it, compiled: refuse to start without it, python: never; the front's
CPU per streamed token 17.8% lower at 16 streams and 13.0% at 64 on 2 cores: `benchmarks/results/2026-11-29-token-lane.json`),
`--gateway-model` (gateway),
`--metrics-host`/`--metrics-port` (127.0.0.1:9002; 0 turns it off), `--max-body-bytes` (4 MiB),
`--default-max-tokens` (256, when a request names none), `--request-timeout-s` (600, one generation),
`--graceful-timeout-s` (30, the drain on SIGTERM), `--log-level` (warning), `--loop` / `FRONT_LOOP` (uvloop;
asyncio costs about 15% more front CPU per streamed token: `benchmarks/results/2026-11-25-front-event-loop.json`),
`--drain-dir` / `LLM_DRAIN_DIR` (unset; where `python -m launcher.drain front` marks a drain: `/health/ready`
answers 503 from then on, docs/operations.md). Client limits (`front/connections.py`, issue 29): `--header-timeout-s`
(10: a request's line and headers after the connection opens, or after their first bytes on a kept-alive connection), `--body-timeout-s` (60: its whole
body after its headers), `--idle-timeout-s` (5: a keep-alive connection without a request), `--max-head-bytes`
(32 KiB: a request's line and headers; a 431 and a close beyond), `--max-connections-per-client` (256 per client address and worker process; 0: no bound), `--preauth-body-bytes`
(64 KiB: a larger or chunked body is read only after its key is checked, up to its tier's bound of
3 x `max_prompt_bytes` + 64 KiB), `--bodies-in-flight-per-key` (4: a key's large bodies being read at once hold at
most this many of those bounds; 429 beyond), `--early-retry-hold-s` (2: a large body of a key the gateway
refused as rate_limited that comes back before its Retry-After waits unread until then, at most this long; still early,
the front refuses it without asking the gateway). `python -m front --help` is the authority.

## Usage ledger and Batch API

([usage.md](usage.md)) Flags of `python -m front` (the launcher passes `--data-dir`, `--ledger-url` and
the worker key through the environment):

| flag | environment | default | what |
|---|---|---|---|
| `--data-dir` | `LLM_DATA_DIR` | unset (the launcher: runtime/data) | spool (`<dir>/spool`) and SQLite ledger (`<dir>/ledger.sqlite3`); unset: no ledger, and `/v1/usage`, `/v1/files`, `/v1/batches` are unknown routes (404) |
| `--ledger-url` | `LLM_LEDGER_URL` | unset | PostgreSQL instead of SQLite |
| `--batch-concurrency` | `LLM_BATCH_CONCURRENCY` | 2 | batch lines this front's worker runs at once (each at the batch tier's priority) |
| `--batch-max-file-bytes` | | 16777216 | largest batch input file (400 naming `file` beyond) |
| `--batch-max-lines` | | 5000 | most requests in one batch file |
| `--replica-id` | `LLM_REPLICA_ID` | host:port | the worker's id in the batch store: a restarted replica resumes the lines it held |
| | `LLM_BATCH_WORKER_KEY` | a new random key per launcher start | the key the worker uses with `on_behalf_of`; the gateway reads the same variable and keeps only its SHA-256 |

Prices (the ledger's `cost`): `price_per_1k_input_tokens` and `price_per_1k_output_tokens` per tenant in
the gateway config (default 0). Batch lines are queued at the `batch` tier's `priority` (3; `tiers.batch`
in the gateway config can change it) with the owning tenant's own limits.
"""


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--check", action="store_true", help="compare instead of writing")
    args = p.parse_args(argv)
    text = generate()
    if args.check:
        if DOC.read_text() != text:
            print(f"{DOC.relative_to(ROOT)} is stale: run python build/knobs_doc.py", file=sys.stderr)
            return 1
        return 0
    DOC.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
