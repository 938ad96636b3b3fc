"""benchmarks/tokenizer_bench.py times the product's encode only where its ids are the tokenizer's."""
import pytest

from benchmarks import tokenizer_bench
from text.tokenization import TokenizerBundle


def test_it_reports_every_prompt_and_refuses_ids_that_differ(checkpoint, monkeypatch):
    bundle = TokenizerBundle.load(checkpoint)
    rows = tokenizer_bench.run(bundle, repeat=1, budget_s=0.005)
    assert [r["prompt"] for r in rows] == list(tokenizer_bench.prompts(bundle))
    by = {r["prompt"]: r for r in rows}
    assert by["64 tokens"]["tokens"] == 64 and by["64 tokens"]["ascii"] and not by["not ASCII"]["ascii"]
    assert all(r["tokenizers_us"] > 0 and r["product_us"] > 0 for r in rows)
    monkeypatch.setattr(bundle, "encode", lambda text: [0])
    with pytest.raises(SystemExit, match="differ"):
        tokenizer_bench.run(bundle, repeat=1, budget_s=0.005)
