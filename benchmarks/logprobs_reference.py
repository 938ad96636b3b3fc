"""How far the API's log probs are from the model's float32 reference: a real stack (tritonserver, gateway,
CPU engine in float32, front) answers chat `logprobs` / `top_logprobs: 20` at temperature 0 and 0.7 and an
lm-evaluation-harness echo request; each value is compared with log_softmax(logits / T) of one plain
float32 forward of the same tokens (`LlamaModel.forward_reference`: no cache, no batching).

    python -m benchmarks.logprobs_reference [--out benchmarks/results/logprobs-reference.json]
"""
from __future__ import annotations

import argparse
import json
import platform
import tempfile
import urllib.request
from pathlib import Path

import numpy as np
import yaml

from gateway.tenants import hash_key
from contracts.logprobs import log_softmax
from text.detokenize import Detokenizer
from text.tokenization import TokenizerBundle
from build.render import DEFAULT_CHECKPOINT
from cpu_engine import EngineConfig, LLMEngine
from launcher.local import LocalStack

CHAT = [{"role": "user", "content": "Name three colours."}]
ECHO_PROMPT = "The capital of France is Paris, and the capital of Italy is Rome."
KEY = "k-bench"


def post(url: str, path: str, body: dict) -> dict:
    req = urllib.request.Request(url + path, json.dumps(body).encode(), {"Authorization": f"Bearer {KEY}"})
    with urllib.request.urlopen(req, timeout=300) as r:
        return json.loads(r.read())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="benchmarks/results/logprobs-reference.json")
    p.add_argument("--max-tokens", type=int, default=32)
    args = p.parse_args()
    reference = LLMEngine(EngineConfig(str(DEFAULT_CHECKPOINT), weight_dtype="float32",
                                       max_tokens_in_paged_kv_cache=256, matmul_backend="numpy")).model.forward_reference
    detok = Detokenizer.from_tokenizer(TokenizerBundle.load(str(DEFAULT_CHECKPOINT)).tokenizer)
    by_bytes: dict[bytes, list[int]] = {}
    for i, b in enumerate(detok.table):
        if b:
            by_bytes.setdefault(b, []).append(i)
    cfg = Path(tempfile.mkdtemp()) / "tenants.yaml"
    cfg.write_text(yaml.safe_dump({"routing": {"default_model": "tensorrt_llm",
                                               "models": {"tensorrt_llm": {"max_context_tokens": 2048}}},
                                   "tenants": {"bench": {"tier": "enterprise", "api_key_sha256": [hash_key(KEY)]}}}))
    stack = LocalStack(overrides={"gateway_config": str(cfg), "weight_dtype": "float32"}, front=True).start()
    report = {"host": platform.node(), "machine": platform.machine(), "weight_dtype": "float32",
              "reference": "LlamaModel.forward_reference (float32, one sequence, no cache)", "chat": {}}
    try:
        url = stack.front_url + "/v1"
        prompt = post(url, "/tokenize", {"messages": CHAT})["tokens"]
        for temperature in (0.0, 0.7):
            body = post(url, "/chat/completions", {"model": "auto", "messages": CHAT, "max_tokens": args.max_tokens,
                                                   "temperature": temperature, "seed": 5, "logprobs": True,
                                                   "top_logprobs": 20})
            content = body["choices"][0]["logprobs"]["content"]
            generated = [by_bytes[bytes(e["bytes"])][0] for e in content]
            logits = reference(prompt + generated)
            chosen, top = [], []
            for j, entry in enumerate(content):
                want = log_softmax(logits[len(prompt) - 1 + j], temperature)
                chosen.append(abs(entry["logprob"] - want[generated[j]]))
                best = np.argsort(-want)[:20]
                top.extend(abs(a["logprob"] - want[b]) for a, b in zip(entry["top_logprobs"], best))
            report["chat"][f"temperature_{temperature}"] = {
                "tokens": len(content), "chosen_max_abs_diff": max(chosen), "top20_max_abs_diff": max(top)}
        ids = post(url, "/tokenize", {"prompt": ECHO_PROMPT})["tokens"]
        out = post(url, "/completions", {"model": "auto", "prompt": [ids], "echo": True, "logprobs": 1,
                                         "max_tokens": 1, "temperature": 0})
        lps = out["choices"][0]["logprobs"]["token_logprobs"]
        logits = reference(ids)
        report["echo"] = {"prompt_tokens": len(ids), "first_is_null": lps[0] is None,
                          "max_abs_diff": max(abs(lps[i] - log_softmax(logits[i - 1])[ids[i]])
                                              for i in range(1, len(ids)))}
    finally:
        stack.stop()
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
