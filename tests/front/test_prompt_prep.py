"""The front's own tokenizing of a lease's prompt (front/prompt_prep.py): what it hands the gateway is what
preprocessing makes of the same request, and it leaves to the gateway what the gateway must do itself."""
import json

import numpy as np
import pytest

from front.openai_schema import GatewayCall
from front import prompt_prep
from front.prompt_prep import KNOWN_KEY_S, PromptPreparer
from front.tool_calls import parse_tools
from gateway.edges import Preprocessed
from text.preprocess import Preprocessor
from text.tokenization import TokenizerBundle

MESSAGES = [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "Name a colour."}]
TOOLS = [{"type": "function", "function": {"name": "paint", "description": "Paint a wall",
                                           "parameters": {"type": "object", "properties": {}}}}]


@pytest.fixture(scope="module")
def preprocess(checkpoint):
    return Preprocessor(TokenizerBundle.load(checkpoint), None)


def lists(out: dict) -> dict:
    return {name: np.asarray(a).tolist() for name, a in out.items()}


def known(preparer: PromptPreparer, key: str = "k-known") -> PromptPreparer:
    preparer.granted(key)
    return preparer


@pytest.mark.parametrize("call, inputs", [
    (GatewayCall(text="Count: one, two,", max_tokens=8, stop=["three", "\n"]),
     dict(query="Count: one, two,", stop_words=["three", "\n"])),
    (GatewayCall(messages=MESSAGES, max_tokens=8, tool_plan=parse_tools({"tools": TOOLS})),
     dict(query=None, messages=json.dumps(MESSAGES), tools=json.dumps(TOOLS))),
    (GatewayCall(prompt_ids=[1, 2, 3], max_tokens=8), dict(query=None, prompt_ids=[1, 2, 3])),
    (GatewayCall(text="hello", max_tokens=8, model="acme-support"), dict(query="hello")),  # an adapter: one tokenizer
])
def test_the_front_hands_the_gateway_what_preprocessing_makes_of_the_request(preprocess, call, inputs):
    prep = known(PromptPreparer(preprocess))(call, "k-known")
    assert prep == lists(preprocess(request_output_len=8, **inputs))
    taken = Preprocessed.from_front(json.loads(json.dumps(prep)), preprocess.tokenizer.vocab_size)
    assert taken.n_input == len(prep["INPUT_ID"][0]) > 0


@pytest.mark.parametrize("call", [
    GatewayCall(text="x" * 101, max_tokens=8),  # over the bound: preprocessing's, in its own process
    GatewayCall(prompt_ids=[1] * 101, max_tokens=8),
    GatewayCall(messages=MESSAGES, max_tokens=8, session_id="s1"),  # the gateway puts the stored turns in front
    GatewayCall(messages=MESSAGES, max_tokens=8, slide_keep=1),  # the gateway may drop the oldest turns
    GatewayCall(text="   ", max_tokens=8),  # refused: the gateway answers it, after the key is checked
    GatewayCall(text="hello", max_tokens=0),
])
def test_what_the_front_leaves_to_the_gateway(preprocess, call):
    assert known(PromptPreparer(preprocess, max_bytes=100))(call, "k-known") is None


def test_the_bound_counts_the_whole_prompt(preprocess):
    short = GatewayCall(messages=[{"role": "user", "content": "y" * 40}], max_tokens=8)
    preparer = known(PromptPreparer(preprocess, max_bytes=100))
    assert preparer(short, "k-known") is not None
    assert preparer(GatewayCall(messages=short.messages, max_tokens=8, tool_plan=parse_tools({"tools": TOOLS})),
                    "k-known") is None  # with its tools


def test_only_a_key_the_gateway_granted_a_lease_lately_gets_its_prompts_tokenized_here(preprocess, monkeypatch):
    """A wrong key, or a tenant the gateway refuses, costs the front no tokenizing: its prompts go the
    gateway's way, where refusals come before any tokenizer time."""
    now = [100.0]
    preparer = PromptPreparer(preprocess, clock=lambda: now[0])
    call = GatewayCall(text="hello", max_tokens=8)
    assert preparer(call, "k-new") is None and preparer(call, None) is None
    preparer.granted("k-new")
    assert preparer(call, "k-new") is not None and preparer(call, "k-other") is None
    assert "k-new" not in "".join(preparer.known)  # kept by digest
    preparer.refused("k-new")  # a 429, say
    assert preparer(call, "k-new") is None
    preparer.granted("k-new")
    now[0] += KNOWN_KEY_S + 1  # no lease since
    assert preparer(call, "k-new") is None
    monkeypatch.setattr(prompt_prep, "MAX_KNOWN_KEYS", 3)
    for key in ("a", "b", "c"):
        preparer.granted(key)
    preparer.granted("d")  # full of live keys: forgets them all rather than grow
    assert preparer(call, "d") is not None and preparer(call, "a") is None and len(preparer.known) == 1
