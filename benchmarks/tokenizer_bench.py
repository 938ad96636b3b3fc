"""What tokenizing a prompt costs: `tokenizers`' own encode against the product's (text/tokenization.py
TokenizerBundle.encode, ASCII text through text/ascii_bpe.py), hot, in one process.

    python benchmarks/tokenizer_bench.py [--repeat 5] [--out benchmarks/results/x.json]

Prompts: the benchmarks' own (loadtest/matrix.py make_prompts, ASCII English) at 64, 512 and 2,048 tokens;
a chat request rendered by SmolLM2's template (its markers are added tokens); the repository's README's
first 16 KiB with what is not ASCII dropped, and as written (a few dozen stretches beyond ASCII: those go
to the tokenizer, the rest not); and a text dense with characters beyond ASCII (the tokenizer's own path
both ways: what is left is the wrapper's cost). Reported per prompt: µs per encode, the best of --repeat
rounds, the ratio and the stretches beyond ASCII. Before it times anything it checks that both give the same
ids for every prompt (tests/text/test_tokenizer_bench.py).
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.report import write_json  # noqa: E402
from loadtest.matrix import make_prompts  # noqa: E402
from text.ascii_bpe import NON_ASCII  # noqa: E402
from text.tokenization import TokenizerBundle  # noqa: E402

NOT_ASCII = "Prices: 3.50 €, 12 ¥ and 7 £ — naïve café déjà vu. " * 8


def prompts(bundle: TokenizerBundle) -> dict[str, list[str]]:
    tok = bundle.tokenizer
    readme = (ROOT / "README.md").read_text()
    return {
        "64 tokens": make_prompts(tok, 32, 64),
        "512 tokens": make_prompts(tok, 16, 512),
        "2048 tokens": make_prompts(tok, 8, 2048),
        "chat, 64 tokens": [bundle.render_chat([{"role": "user", "content": p}]) for p in make_prompts(tok, 32, 64)],
        "README, 16 KiB, ASCII": [readme.encode("ascii", "ignore").decode()[:16384]],
        "README, 16 KiB": [readme[:16384]],
        "not ASCII": [NOT_ASCII],
    }


def best_us(encode, texts: list[str], repeat: int, budget_s: float = 0.3) -> float:
    """µs per encode, the best of `repeat` rounds of about budget_s each."""
    encode(texts[0])
    start, n = time.perf_counter(), 0
    while time.perf_counter() - start < 0.05:
        encode(texts[n % len(texts)])
        n += 1
    calls = max(len(texts), int(n * budget_s / 0.05))
    best = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        for i in range(calls):
            encode(texts[i % len(texts)])
        best = min(best, (time.perf_counter() - start) / calls)
    return best * 1e6


def run(bundle: TokenizerBundle, repeat: int, budget_s: float = 0.3) -> list[dict]:
    tok, add_special = bundle.tokenizer, bool(bundle.config.get("add_bos_token", False))

    def theirs(text):
        return tok.encode(text, add_special_tokens=add_special).ids

    rows = []
    for name, texts in prompts(bundle).items():
        for text in texts:
            if bundle.encode(text) != theirs(text):
                raise SystemExit(f"{name}: the product's ids differ from the tokenizer's")
        before = best_us(theirs, texts, repeat, budget_s)
        after = best_us(bundle.encode, texts, repeat, budget_s)
        rows.append({"prompt": name, "tokens": round(sum(len(theirs(t)) for t in texts) / len(texts)),
                     "ascii": all(t.isascii() for t in texts),
                     "stretches_beyond_ascii": max(len(NON_ASCII.findall(t)) for t in texts),
                     "tokenizers_us": round(before, 2),
                     "product_us": round(after, 2), "speedup": round(before / after, 2)})
    return rows


def main(argv=None) -> int:
    from build.render import DEFAULT_CHECKPOINT

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    rows = run(TokenizerBundle.load(DEFAULT_CHECKPOINT), args.repeat)
    print(f"{'prompt':<18} {'tokens':>6} {'tokenizers µs':>14} {'product µs':>11} {'speedup':>8}")
    for r in rows:
        print(f"{r['prompt']:<18} {r['tokens']:>6} {r['tokenizers_us']:>14} {r['product_us']:>11} {r['speedup']:>7}x")
    if args.out:
        write_json(args.out, {"rows": rows}, args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
