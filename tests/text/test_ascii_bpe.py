"""AsciiBpe gives `tokenizers`' own ids for ASCII text, on SmolLM2's real tokenizer and on other models'
byte-level pipelines built from it, and refuses every pipeline or text it does not reproduce."""
import json
import random
from pathlib import Path

import pytest
from tokenizers import Tokenizer

import text.ascii_bpe as ascii_bpe
from text.ascii_bpe import LLAMA3, QWEN2, AsciiBpe, ascii_pattern
from text.tokenization import TokenizerBundle

ROOT = Path(__file__).resolve().parents[2]
BYTES_ONLY = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": False}


def _corpus() -> list[str]:
    """The repository's docs cut into pieces, ASCII only, and random ASCII: every byte, the patterns' edge
    cases (contractions in either case, digit runs, whitespace runs before text, CR/LF mixes) and added
    tokens, whole and cut."""
    texts = []
    for path in sorted((ROOT / "docs").glob("*.md"))[:6]:
        doc = path.read_text().encode("ascii", "ignore").decode()
        texts += [doc[i:i + 500] for i in range(0, min(len(doc), 20000), 500)]
    rnd = random.Random(28)
    pools = [[chr(c) for c in range(128)], list(" \t\n\r\x0b\x0c'sdtvmlreSDTVMLRE0123456789aZ!?.,<|>_"),
             list("ab 12'\n\n  \r\n"), [" It's", "'LL", " 1234", "\r\n", "   ", "\n\n\n", "x", "<|im_start|>",
                                          "<|im_end|>", "<|im_", "end|>", "<|endoftext|>", " 42", "??", "\t"]]
    for _ in range(2500):
        pool = rnd.choice(pools)
        texts.append("".join(rnd.choice(pool) for _ in range(rnd.randint(0, 40))))
    return texts


CORPUS = _corpus()


def _mixed_corpus() -> list[str]:
    """ASCII with characters beyond it: letters, accents and combining marks, quotes and dashes, white space
    that is not ASCII's (NBSP, em space, ideographic space, NEL, line separator), digits that are not ASCII's,
    CJK, emoji; next to spaces, digits, punctuation and added tokens."""
    rnd = random.Random(29)
    beyond = list("é’“”—\u00a0\u2003\u3000\u0085\u2028東🚀²٣\u0301ñ")
    ascii_parts = list(" \t\n\r'sdtvmlre0123456789aZ!?.,<|>_") + [" the", " It's", "  ", "\n\n", "<|im_start|>",
                                                                   "<|im_end|>", " 42"]
    return ["".join(rnd.choice(beyond) if rnd.random() < share else rnd.choice(ascii_parts)
                    for _ in range(rnd.randint(1, 120)))
            for share in (0.02, 0.25) for _ in range(1500)]


MIXED = _mixed_corpus()


@pytest.fixture(scope="module")
def smollm2(checkpoint) -> Tokenizer:
    return TokenizerBundle.load(checkpoint).tokenizer


def _variant(tokenizer: Tokenizer, **changes) -> Tokenizer:
    spec = json.loads(tokenizer.to_str())
    model = changes.pop("model", None)
    spec.update(changes)
    if model:
        spec["model"].update(model)
    return Tokenizer.from_str(json.dumps(spec))


def _same_ids(tokenizer: Tokenizer, fast: AsciiBpe, add_special: bool = False) -> None:
    for text in CORPUS:
        want = tokenizer.encode(text, add_special_tokens=add_special).ids
        assert fast.encode(text, add_special) == want, repr(text)


def test_smollm2s_ids_are_the_tokenizers_own(smollm2):
    fast = AsciiBpe.for_tokenizer(smollm2)
    assert fast is not None
    _same_ids(smollm2, fast)
    assert fast.encode("<|im_start|>user\nHi<|im_end|>") == smollm2.encode("<|im_start|>user\nHi<|im_end|>").ids
    assert fast.encode("<|im_start|>user")[0] == smollm2.token_to_id("<|im_start|>")  # the added token, whole


@pytest.mark.parametrize("name,changes", [
    ("llama3", {"pre_tokenizer": {"type": "Sequence", "pretokenizers": [
        {"type": "Split", "pattern": {"Regex": LLAMA3}, "behavior": "Isolated", "invert": False}, BYTES_ONLY]},
        "model": {"ignore_merges": True}}),
    ("qwen2", {"normalizer": {"type": "NFC"}, "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
        {"type": "Split", "pattern": {"Regex": QWEN2}, "behavior": "Isolated", "invert": False}, BYTES_ONLY]}}),
    ("gpt2", {"pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True,
                                "use_regex": True}}),
    ("digit-runs", {"pre_tokenizer": {"type": "Sequence", "pretokenizers": [
        {"type": "Digits", "individual_digits": False}, {**BYTES_ONLY, "use_regex": True}]}}),
    ("a-string-split", {"pre_tokenizer": {"type": "Sequence", "pretokenizers": [
        {"type": "Split", "pattern": {"String": "'"}, "behavior": "Isolated", "invert": False},
        {**BYTES_ONLY, "use_regex": True}]}}),
])
def test_other_models_pipelines_give_the_tokenizers_own_ids(smollm2, name, changes):
    tokenizer = _variant(smollm2, **changes)
    fast = AsciiBpe.for_tokenizer(tokenizer)
    assert fast is not None, name
    _same_ids(tokenizer, fast)


@pytest.mark.parametrize("name,changes", [
    ("smollm2", {}),
    ("llama3", {"pre_tokenizer": {"type": "Sequence", "pretokenizers": [
        {"type": "Split", "pattern": {"Regex": LLAMA3}, "behavior": "Isolated", "invert": False}, BYTES_ONLY]}}),
    ("qwen2's pattern, no normalizer", {"pre_tokenizer": {"type": "Sequence", "pretokenizers": [
        {"type": "Split", "pattern": {"Regex": QWEN2}, "behavior": "Isolated", "invert": False}, BYTES_ONLY]}}),
    ("digit runs", {"pre_tokenizer": {"type": "Sequence", "pretokenizers": [
        {"type": "Digits", "individual_digits": False}, {**BYTES_ONLY, "use_regex": True}]}}),
])
def test_text_beyond_ascii_is_cut_where_the_patterns_cut_it(smollm2, name, changes, monkeypatch):
    """Stretches beyond ASCII go to the tokenizer, the ASCII around them here: the same ids. With one
    stretch allowed per character every text of the corpus takes that path."""
    tokenizer = _variant(smollm2, **changes)
    monkeypatch.setattr(ascii_bpe, "RUN_CHARS", 1)
    fast = AsciiBpe.for_tokenizer(tokenizer)
    assert fast.mixed
    for text in MIXED:
        assert fast.encode(text) == tokenizer.encode(text, add_special_tokens=False).ids, repr(text)


def test_text_dense_beyond_ascii_or_patterns_it_cannot_cut_go_to_the_tokenizer_whole(smollm2):
    fast = AsciiBpe.for_tokenizer(smollm2)
    assert fast.encode("A long English sentence, then one “quoted” word" + " and more plain words" * 5) is not None
    assert fast.encode("naïve café déjà vu, ¥ € £") is None  # several stretches in a few characters
    for changes in ({"normalizer": {"type": "NFC"}, "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": QWEN2}, "behavior": "Isolated", "invert": False}, BYTES_ONLY]}},
            {"pre_tokenizer": {"type": "Sequence", "pretokenizers": [
                {"type": "Split", "pattern": {"String": "'"}, "behavior": "Isolated", "invert": False},
                {**BYTES_ONLY, "use_regex": True}]}}):
        other = AsciiBpe.for_tokenizer(_variant(smollm2, **changes))
        assert not other.mixed and other.encode("plain ASCII, then “quoted”" + " words" * 30) is None


def test_a_post_processor_that_adds_tokens_is_left_to_the_tokenizer_only_when_asked_to(smollm2):
    tokenizer = _variant(smollm2, post_processor={
        "type": "TemplateProcessing", "single": [{"SpecialToken": {"id": "<|im_start|>", "type_id": 0}},
                                                 {"Sequence": {"id": "A", "type_id": 0}}],
        "pair": [{"Sequence": {"id": "A", "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 1}}],
        "special_tokens": {"<|im_start|>": {"id": "<|im_start|>", "ids": [1], "tokens": ["<|im_start|>"]}}})
    fast = AsciiBpe.for_tokenizer(tokenizer)
    assert fast.encode("Hello", add_special_tokens=True) is None
    assert tokenizer.encode("Hello").ids[0] == 1  # it does add one
    _same_ids(tokenizer, fast, add_special=False)


@pytest.mark.parametrize("name,changes", [
    ("a prefix space", {"pre_tokenizer": {**BYTES_ONLY, "add_prefix_space": True, "use_regex": True}}),
    ("not byte-level", {"pre_tokenizer": {"type": "Metaspace", "replacement": "\u2581", "prepend_scheme": "always",
                                          "split": True}}),
    ("bytes mapped before a split", {"pre_tokenizer": {"type": "Sequence", "pretokenizers": [
        BYTES_ONLY, {"type": "Digits", "individual_digits": True}]}}),
    ("lowercased", {"normalizer": {"type": "Lowercase"}}),
    ("an upper-case class", {"pre_tokenizer": {"type": "Sequence", "pretokenizers": [
        {"type": "Split", "pattern": {"Regex": r"\p{Lu}+"}, "behavior": "Isolated", "invert": False}, BYTES_ONLY]}}),
    ("a word class", {"pre_tokenizer": {"type": "Sequence", "pretokenizers": [
        {"type": "Split", "pattern": {"Regex": r"\w+"}, "behavior": "Isolated", "invert": False}, BYTES_ONLY]}}),
    ("removed matches", {"pre_tokenizer": {"type": "Sequence", "pretokenizers": [
        {"type": "Split", "pattern": {"Regex": " "}, "behavior": "Removed", "invert": False}, BYTES_ONLY]}}),
    ("an empty match", {"pre_tokenizer": {"type": "Sequence", "pretokenizers": [
        {"type": "Split", "pattern": {"Regex": "a*"}, "behavior": "Isolated", "invert": False}, BYTES_ONLY]}}),
    ("padding", {"padding": {"strategy": {"Fixed": 8}, "direction": "Right", "pad_to_multiple_of": None,
                             "pad_id": 0, "pad_type_id": 0, "pad_token": "<|endoftext|>"}}),
    ("dropout", {"model": {"dropout": 0.1}}),
])
def test_pipelines_it_does_not_reproduce_are_the_tokenizers(smollm2, name, changes):
    assert AsciiBpe.for_tokenizer(_variant(smollm2, **changes)) is None, name


def test_an_added_token_with_strip_rules_is_the_tokenizers(smollm2):
    spec = json.loads(smollm2.to_str())
    spec["added_tokens"][1]["lstrip"] = True
    assert AsciiBpe.for_tokenizer(Tokenizer.from_str(json.dumps(spec))) is None


def test_the_bundle_answers_every_text_with_the_tokenizers_ids(smollm2, checkpoint, monkeypatch):
    bundle = TokenizerBundle.load(checkpoint)
    # built with the bundle, not in the first request's encode (reading the pipeline takes tens of ms)
    assert bundle.ascii_bpe is not None
    monkeypatch.setattr(AsciiBpe, "for_tokenizer", lambda tokenizer: pytest.fail("built at an encode"))
    for text in ("naïve café", "Emoji 🚀 then ASCII" + " words" * 20, "plain ASCII 123", *MIXED[:200]):
        assert bundle.encode(text) == smollm2.encode(text).ids


def test_patterns_translate_for_ascii_or_not_at_all():
    assert ascii_pattern(r" ?\p{L}+") == " ?[A-Za-z]+"
    assert ascii_pattern(r"[^\s\p{L}\p{N}]") == "[^\\t\\n\\x0b\\x0c\\r A-Za-z0-9]"
    assert ascii_pattern(r"\s+(?!\S)") == "[\\t\\n\\x0b\\x0c\\r ]+(?![^\\t\\n\\x0b\\x0c\\r ])"
    assert ascii_pattern(r"[^]a]") == "[^\\]a]"
    # Oniguruma's meaning differs, or is not checked: a negated Unicode class, another one, \S in a class, \d,
    # a possessive quantifier, a nested class, `$` (a line's end there), a capturing group, an inline flag
    for pattern in (r"\P{L}", r"\p{Lu}", r"[\S]", r"\d+", r"a++", r"[[a]]", r"a$", r"(a)|b", r"(?m:a)",
                    r"(?<n>a)"):
        assert ascii_pattern(pattern) is None, pattern


def test_the_word_cache_is_bounded_and_stays_exact(smollm2, monkeypatch):
    monkeypatch.setattr(ascii_bpe, "MAX_CACHED_WORDS", 50)
    fast = AsciiBpe.for_tokenizer(smollm2)
    for text in CORPUS[:300]:
        assert fast.encode(text) == smollm2.encode(text).ids
        assert len(fast.words) <= 50
