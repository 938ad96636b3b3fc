"""llama.cpp's own n-gram speculation (`llama-server --spec-type ngram-simple`) against its plain decoding,
on the workloads of benchmarks/spec_decode_bench.py: the peer's figure beside the CPU engine's prompt lookup.

    python benchmarks/peer/spec_decode_peer.py [--streams 1,16] [--rounds 2] [--threads 1]
        [--out benchmarks/results/spec_decode_peer.json]

Two `llama-server`s on the project's GGUF (built by `make bench-peer`), started together and used in turns:
one plain, one with `--spec-type ngram-simple` (by default drafting like the engine's lookahead config: a
match of up to 3 tokens proposes up to 7). Requests are the same chat messages (`/v1/chat/completions`,
greedy, --new-tokens, prompt cache off), so both arms do the same work; pairs run back to back with the
arm that goes first alternating, as spec_decode_bench does, and are summarized by the same code. Tokens
per step are derived from the server's own counts (a verification step yields its accepted drafts plus
one token: steps = tokens - accepted drafts).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from benchmarks.spec_decode_bench import WORKLOADS, measure, write_results  # noqa: E402
from benchmarks.triton_bench import PEER_SERVER, PeerServer  # noqa: E402
from contracts.measures import throughput  # noqa: E402


def complete(url: str, text: str, new_tokens: int) -> dict:
    body = {"messages": [{"role": "user", "content": text}], "max_tokens": new_tokens, "temperature": 0.0,
            "cache_prompt": False}
    req = urllib.request.Request(f"{url}/v1/chat/completions", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=600) as resp:
        return json.loads(resp.read())


def run_arm(url: str, texts: list[str], streams: int, per_stream: int, new_tokens: int) -> dict:
    """`streams` threads, each sending `per_stream` requests one after another (text i cycles)."""
    lock = threading.Lock()
    outputs, errors = {}, []

    def client(cid: int):
        for k in range(per_stream):
            index = cid * per_stream + k
            try:
                got = complete(url, texts[index % len(texts)], new_tokens)
            except Exception as e:  # noqa: BLE001 (reported, not raised, so the other threads finish)
                errors.append(repr(e))
                return
            with lock:
                outputs[index] = got

    threads = [threading.Thread(target=client, args=(c,)) for c in range(streams)]
    start = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    end = time.perf_counter()
    tokens = sum(o["usage"]["completion_tokens"] for o in outputs.values())
    drafted = sum(o.get("timings", {}).get("draft_n", 0) for o in outputs.values())
    accepted = sum(o.get("timings", {}).get("draft_n_accepted", 0) for o in outputs.values())
    return {"wall_s": round(end - start, 3), "steps": tokens - accepted, "output_tokens": tokens,
            "tok_s": round(throughput(tokens, start, end), 2), "draft_tokens": drafted,
            "accepted_draft_tokens": accepted, "errors": errors,
            "_tokens": {i: o["choices"][0]["message"]["content"] for i, o in outputs.items()}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--server", type=Path, default=PEER_SERVER)
    ap.add_argument("--streams", default="1,16")
    ap.add_argument("--workloads", default=",".join(WORKLOADS))
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--ngram-size-n", type=int, default=3, help="lookup n-gram (the engine's max_matching_ngram_size)")
    ap.add_argument("--ngram-size-m", type=int, default=7, help="draft m-gram (the engine's lookahead_ngram_size - 1)")
    ap.add_argument("--threads", type=int, default=None,
                    help="llama-server -t (default: all cores); 1 keeps a step's cost its own compute on a busy "
                         "shared host, where llama.cpp's threads spin for each other's time slices")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "spec_decode_peer.json"))
    args = ap.parse_args()
    if not args.server.exists():
        sys.exit(f"{args.server} not found: build the peer with `make bench-peer` "
                 "(or bash benchmarks/peer/build_llama_server.sh)")

    slots = max(int(s) for s in args.streams.split(","))
    spec = ("--spec-type", "ngram-simple", "--spec-ngram-simple-size-n", str(args.ngram_size_n),
            "--spec-ngram-simple-size-m", str(args.ngram_size_m))
    threads = args.threads or os.cpu_count()
    servers = {"plain": PeerServer(args.server, slots, threads=threads),
               "lookahead": PeerServer(args.server, slots, spec, threads=threads)}
    for s in servers.values():
        s.start()
    try:
        for s in servers.values():  # warm up: first request pays page faults and thread start
            complete(s.url, WORKLOADS["edit"][0], 16)
        levels = measure({w: WORKLOADS[w] for w in args.workloads.split(",")},
                         [int(s) for s in args.streams.split(",")], args.rounds,
                         lambda arm, batch, streams, per_stream: run_arm(servers[arm].url, batch, streams, per_stream,
                                                                         args.new_tokens), label="ngram")
    finally:
        for s in servers.values():
            s.stop()
    write_results(args, {
        "what": "llama.cpp llama-server: n-gram speculation (--spec-type ngram-simple) vs plain, same window",
        "engine": {"describe": f"llama.cpp llama-server ({args.server.parent.parent.parent.name}) on the project's "
                               f"GGUF, -t {threads}, -np {slots}, " + " ".join(spec),
                   "num_threads": threads},
        "levels": levels,
    })


if __name__ == "__main__":
    main()
