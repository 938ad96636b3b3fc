"""llama.cpp's own speculation against its plain decoding, on the workloads of benchmarks/spec_decode_bench.py:
the peer's figure beside the CPU engine's. `--method ngram`: n-gram lookup (`--spec-type ngram-simple`), beside
the engine's prompt lookup; `--method draft`: a draft model (`--spec-type draft-simple -md`), beside the
engine's `draft_tokens_external` as spec_decode_bench measures it (a full-precision model drafted by its own
8-bit copy): here a 16-bit copy of the project's GGUF drafted by its Q8_0 copy, both made once with
llama-quantize from the GGUF (a 16-bit copy of Q4_1 weights holds them exactly).

    python benchmarks/peer/spec_decode_peer.py [--method ngram|draft] [--streams 1,16] [--rounds 2] [--threads 1]
        [--out benchmarks/results/spec_decode_peer.json]

Two `llama-server`s (built by `make bench-peer`), started together and used in turns: one plain, one
speculating (ngram: by default drafting like the engine's lookahead config, a match of up to 3 tokens
proposes up to 7; draft: up to --draft-n-max tokens a step). Requests are the same chat messages (`/v1/chat/completions`,
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
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from benchmarks.report import run_clients  # noqa: E402
from benchmarks.spec_decode_bench import WORKLOADS, measure, write_results  # noqa: E402
from benchmarks.triton_bench import PEER_SERVER, PeerServer  # noqa: E402
from build.prepare_model import GGUF_NAME  # noqa: E402
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

    start, end = run_clients(client, streams)
    tokens = sum(o["usage"]["completion_tokens"] for o in outputs.values())
    drafted = sum(o.get("timings", {}).get("draft_n", 0) for o in outputs.values())
    accepted = sum(o.get("timings", {}).get("draft_n_accepted", 0) for o in outputs.values())
    return {"wall_s": round(end - start, 3), "steps": tokens - accepted, "output_tokens": tokens,
            "tok_s": round(throughput(tokens, start, end), 2), "draft_tokens": drafted,
            "accepted_draft_tokens": accepted, "errors": errors,
            "_tokens": {i: o["choices"][0]["message"]["content"] for i, o in outputs.items()}}


def quantized_copy(server: Path, kind: str) -> Path:
    """The project's GGUF at another type (F16, Q8_0), made once by llama-quantize beside the peer's build."""
    from build.prepare_model import find_gguf

    out = server.parent.parent.parent / "models" / GGUF_NAME.replace(".Q4_1.", f".{kind}.")
    if not out.exists():
        import subprocess

        out.parent.mkdir(parents=True, exist_ok=True)
        quantize = server.parent / "llama-quantize"
        if not quantize.exists():
            sys.exit(f"{quantize} not found: rebuild the peer (bash benchmarks/peer/build_llama_server.sh)")
        print(f"[peer] writing {out.name} with llama-quantize", file=sys.stderr, flush=True)
        done = subprocess.run([str(quantize), "--allow-requantize", str(find_gguf()), str(out) + ".part", kind],
                              capture_output=True, text=True)
        if done.returncode:
            sys.exit(f"llama-quantize failed ({done.returncode}):\n" + done.stderr[-2000:])
        Path(str(out) + ".part").rename(out)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--server", type=Path, default=PEER_SERVER)
    ap.add_argument("--method", choices=("ngram", "draft"), default="ngram")
    ap.add_argument("--draft-n-max", type=int, default=4, help="draft: tokens drafted a step (the engine's "
                                                               "lookahead_ngram_size - 1 in spec_decode_bench's run)")
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
    model = None
    if args.method == "ngram":
        spec = ("--spec-type", "ngram-simple", "--spec-ngram-simple-size-n", str(args.ngram_size_n),
                "--spec-ngram-simple-size-m", str(args.ngram_size_m))
    else:
        model = quantized_copy(args.server, "F16")
        spec = ("--spec-type", "draft-simple", "-md", str(quantized_copy(args.server, "Q8_0")),
                "--spec-draft-n-max", str(args.draft_n_max), "--spec-draft-n-min", "0")
    threads = args.threads or os.cpu_count()
    servers = {"plain": PeerServer(args.server, slots, threads=threads, model=model),
               "lookahead": PeerServer(args.server, slots, spec, threads=threads, model=model)}
    for s in servers.values():
        s.start()
    try:
        for s in servers.values():  # warm up: first request pays page faults and thread start
            complete(s.url, WORKLOADS["edit"][0], 16)
        levels = measure({w: WORKLOADS[w] for w in args.workloads.split(",")},
                         [int(s) for s in args.streams.split(",")], args.rounds,
                         lambda arm, batch, streams, per_stream: run_arm(servers[arm].url, batch, streams, per_stream,
                                                                         args.new_tokens), label=args.method)
    finally:
        for s in servers.values():
            s.stop()
    what = {"ngram": "n-gram speculation (--spec-type ngram-simple)",
            "draft": "draft-model speculation (--spec-type draft-simple, the F16 copy drafted by the Q8_0 copy)"}
    write_results(args, {
        "what": f"llama.cpp llama-server: {what[args.method]} vs plain, same window",
        "engine": {"describe": f"llama.cpp llama-server ({args.server.parent.parent.parent.name}) on "
                               f"{model.name if model else GGUF_NAME}, -t {threads}, -np {slots}, "
                               + " ".join(Path(a).name if a.endswith(".gguf") else a for a in spec),
                   "num_threads": threads, "speculating": {"ngram": "ngram", "draft": "draft model"}[args.method]},
        "levels": levels,
    })


if __name__ == "__main__":
    main()
