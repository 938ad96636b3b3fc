"""What guided decoding costs on the CPU engine: the token mask per step (llguidance over SmolLM2's vocabulary)
and whole greedy requests with and without a JSON-schema guide, in process.

    python -m benchmarks.guided_bench [--out benchmarks/results/<date>-guided-decoding.json]
"""
from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

import numpy as np

from text.tokenization import TokenizerBundle
from build.render import DEFAULT_CHECKPOINT
from cpu_engine import EngineConfig, LLMEngine, SamplingParams
from cpu_engine.guided import GuideSpec, constrain

SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "country": {"type": "string"},
                                           "is_capital": {"type": "boolean"},
                                           "population_millions": {"type": "integer", "minimum": 0,
                                                                   "maximum": 2 ** 53 - 1}},
          "required": ["name", "country", "is_capital", "population_millions"], "additionalProperties": False}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path)
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args()
    tok = TokenizerBundle.load(DEFAULT_CHECKPOINT)
    engine = LLMEngine(EngineConfig(str(DEFAULT_CHECKPOINT), max_tokens_in_paged_kv_cache=4096))
    spec = GuideSpec("json_schema", json.dumps(SCHEMA))
    prompt = tok.encode(tok.render_chat([{"role": "user", "content": "Describe the city of Paris."}]))

    # the mask alone: one guided answer replayed token by token
    answer = engine.generate(prompt, SamplingParams(64, temperature=0.0, end_id=tok.end_of_turn_id, guide=spec))
    guide = engine.guides.matcher(spec, tok.end_of_turn_id)
    row = np.zeros(engine.weights.config.vocab_size, np.float32)
    mask_ms = []
    for token in answer.new_token_ids:
        t = time.perf_counter()
        constrain(guide, row)
        mask_ms.append((time.perf_counter() - t) * 1000)
        guide.accept(token)

    def timed(guided: bool) -> tuple[float, int]:
        runs = []
        for _ in range(args.repeats):
            t = time.perf_counter()
            out = engine.generate(prompt, SamplingParams(64, temperature=0.0, end_id=tok.end_of_turn_id,
                                                         guide=spec if guided else None))
            runs.append(((time.perf_counter() - t) * 1000 / max(1, len(out.new_token_ids)), len(out.new_token_ids)))
        return statistics.median(r[0] for r in runs), runs[0][1]

    free_ms, free_n = timed(False)
    guided_ms, guided_n = timed(True)
    result = {
        "what": "CPU engine guided decoding: llguidance token mask per step, and greedy requests per token with and "
                "without a JSON-schema guide (single request, in process, engine default weight dtype)",
        "host": {"machine": platform.machine(), "processor": platform.processor(), "python": platform.python_version()},
        "weight_dtype": engine.weights.weight_dtype,
        "vocab_size": engine.weights.config.vocab_size,
        "guided_answer": tok.tokenizer.decode(answer.new_token_ids),
        "mask_ms": {"median": round(statistics.median(mask_ms), 3), "p90": round(sorted(mask_ms)[int(0.9 * len(mask_ms))], 3),
                    "max": round(max(mask_ms), 3), "steps": len(mask_ms)},
        "request_ms_per_token": {"free": round(free_ms, 2), "guided": round(guided_ms, 2),
                                 "free_tokens": free_n, "guided_tokens": guided_n},
        "repeats": args.repeats,
    }
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
