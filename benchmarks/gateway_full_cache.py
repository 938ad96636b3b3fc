"""The gateway under a full KV cache (issue 18, finding 10): how long a new request waits for its first
token, and how long an impossible request takes to be refused, through the gateway and the ensemble.

    python benchmarks/gateway_full_cache.py [--kv-tokens 2048] [--streams 16] [--max-tokens 256]

Starts its own tritonserver (CPU repository, `max_tokens_in_paged_kv_cache` = --kv-tokens), opens
--streams long greedy gateway streams (forced length), waits until the engine has requests waiting for
KV blocks, then times, all at once, a short request (to its first token) and an impossible one (prompt
+ max_tokens over the cache) through the gateway and through the ensemble. Prints one JSON object.
"""
from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import yaml  # noqa: E402

from gateway.tenants import hash_key  # noqa: E402
from clients.llm import LLMClient, LLMError  # noqa: E402
from clients.prometheus import metric_value  # noqa: E402
from build.render import parse_sets  # noqa: E402
from launcher.local import LocalStack  # noqa: E402

TENANTS = {
    "routing": {"default_model": "tensorrt_llm", "models": {"tensorrt_llm": {"max_context_tokens": 8192}}},
    "tenants": {"bench": {"tier": "enterprise", "api_key_sha256": [hash_key("k-bench")],
                          "limits": {"max_concurrent": 64, "requests_per_minute": 10_000,
                                     "tokens_per_minute": 10_000_000}}},
}


def timed(fn):
    t0 = time.perf_counter()
    try:
        out = fn()
        return {"ok": True, "s": round(time.perf_counter() - t0, 3), "detail": out}
    except LLMError as e:
        return {"ok": False, "s": round(time.perf_counter() - t0, 3), "detail": str(e)[:160]}


def first_token(client: LLMClient, prompt: str) -> str:
    for piece in client.stream(prompt, max_tokens=8, temperature=0.0, cancel_after=1):
        return piece
    return ""


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--kv-tokens", type=int, default=2048)
    p.add_argument("--streams", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--set", action="append", default=[], metavar="KNOB=VALUE", help="more render overrides")
    args = p.parse_args(argv)
    work = Path(__file__).resolve().parent / "results"
    cfg = work / ".gateway_full_cache.yaml"
    cfg.write_text(yaml.safe_dump(TENANTS))
    overrides = {"gateway_config": str(cfg), "max_tokens_in_paged_kv_cache": str(args.kv_tokens)}
    overrides.update(parse_sets(args.set))
    report = {"kv_tokens": args.kv_tokens, "streams": args.streams, "max_tokens": args.max_tokens,
              "overrides": overrides}
    with LocalStack(overrides=overrides) as server:
        gw = LLMClient(server.grpc_url, api_key="k-bench", timeout_s=600)
        ens = LLMClient(server.grpc_url, model="ensemble", timeout_s=600)
        first_token(gw, "Hello")  # warm
        done, errors = [], []

        def long_stream(i):
            try:
                r = gw.generate(f"Stream {i}: count slowly from one to a thousand:", max_tokens=args.max_tokens,
                                min_tokens=args.max_tokens, temperature=0.0)
                done.append(r.num_output_tokens)
            except LLMError as e:
                errors.append(str(e)[:120])

        threads = [threading.Thread(target=long_stream, args=(i,)) for i in range(args.streams)]
        t0 = time.perf_counter()
        for t in threads:
            t.start()
        # wait until the engine is full: requests running and more waiting for KV blocks
        while time.perf_counter() - t0 < 60:
            m = server.metrics()
            if (metric_value(m, "nv_trt_llm_request_metrics", request_type="waiting") or 0) > 0:
                break
            time.sleep(0.1)
        report["engine_full_after_s"] = round(time.perf_counter() - t0, 2)
        m = server.metrics()
        report["at_probe"] = {
            "engine_active": metric_value(m, "nv_trt_llm_request_metrics", request_type="active"),
            "engine_waiting": metric_value(m, "nv_trt_llm_request_metrics", request_type="waiting"),
            "gateway_admission_queue": metric_value(m, "gateway_admission_queue_depth", model="tensorrt_llm")}
        impossible = "Too long " * 20
        too_many = args.kv_tokens  # plus the prompt: more than the cache can ever hold
        probes = {  # all at the same moment, so the gateway and the ensemble meet the same engine queue
            "gateway_impossible": lambda: gw.generate(impossible, max_tokens=too_many).text,
            "ensemble_impossible": lambda: ens.generate(impossible, max_tokens=too_many).text,
            "gateway_first_token": lambda: first_token(gw, "Say hi"),
            "ensemble_first_token": lambda: first_token(ens, "Say hi"),
        }
        probe_threads = [threading.Thread(target=lambda k=k, f=f: report.__setitem__(k, timed(f)))
                         for k, f in probes.items()]
        for t in probe_threads:
            t.start()
        for t in probe_threads:
            t.join()
        for t in threads:
            t.join()
        report["long_streams_s"] = round(time.perf_counter() - t0, 2)
        report["long_streams_done"] = len(done)
        report["long_stream_errors"] = errors[:3]
    print(json.dumps(report, indent=2))
    cfg.unlink()
    return 0


if __name__ == "__main__":
    sys.exit(main())
