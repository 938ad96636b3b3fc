"""A lease's prompt tokenized in the front's own process, for the gateway to take in place of a call to
`preprocessing`.

Every request the front streams from the engine is admitted by the gateway's one process, which otherwise
asks `preprocessing` (another Triton model, its own process) for the prompt's tokens: a Triton request and
two IPC round trips more per request on the path that bounds the whole server's request rate. The front
has the tokenizer already (it detokenizes), runs as several workers, and here runs the very same
`text.preprocess.Preprocessor`, so the gateway only checks what it is handed (gateway/edges.py
`Preprocessed.from_front`) and does the rest of its policy as before.

Only keys the gateway granted a lease in the last `KNOWN_KEY_S` get their prompts tokenized here (by the
digest, front/keys.py): the front tokenizes before the gateway has checked anything, so a request with a
wrong key, or of a tenant the gateway is refusing (rate limits, quotas), would otherwise cost this worker
its tokenizing for nothing; their first request, and every one after a refusal, goes the gateway's way,
where refusals come before any tokenizer time (docs/gateway.md, Work charged before it is done).

Tokenizing runs on the worker's event loop (2.2-3.1 ms at the bound, 14-18 ms at 16 KiB on the 2-core host:
benchmarks/results/2026-11-27-front-tokenizes-prompts.json; ASCII text 5-10x less since text/ascii_bpe.py,
2026-11-29-tokenizer-bench.json), so prompts over `max_bytes` are left to the gateway and `preprocessing`,
as are requests whose prompt the gateway changes (a session's stored turns, a conversation it may slide)
and prompts the preprocessor refuses: the gateway answers those with its errors in its order (a bad key
before a bad prompt). A prompt for a LoRA adapter (its name as the model) is tokenized here as any other:
the adapter changes the engine's weights, not the tokenizer."""
from __future__ import annotations

import time

from front.gateway_client import gateway_values
from front.keys import key_digest
from front.openai_schema import GatewayCall
from text.preprocess import Preprocessor

DEFAULT_MAX_BYTES = 4096  # characters of text, messages and tools (about 1,300 tokens)
KNOWN_KEY_S = 60.0  # a key's last lease: how long its prompts are tokenized here after it
MAX_KNOWN_KEYS = 65536


class PromptPreparer:
    def __init__(self, preprocess: Preprocessor, max_bytes: int = DEFAULT_MAX_BYTES, clock=time.monotonic):
        self.preprocess, self.max_bytes, self.clock = preprocess, max_bytes, clock
        self.known: dict[str, float] = {}  # key digest -> until when its prompts are tokenized here

    def granted(self, api_key: str | None) -> None:
        """The gateway granted this key a lease."""
        if api_key:
            if len(self.known) >= MAX_KNOWN_KEYS:  # forget the lapsed ones, or everyone
                now = self.clock()
                self.known = {k: t for k, t in self.known.items() if t > now}
                if len(self.known) >= MAX_KNOWN_KEYS:
                    self.known.clear()
            self.known[key_digest(api_key)] = self.clock() + KNOWN_KEY_S

    def refused(self, api_key: str | None) -> None:
        """The gateway refused this key's admission: its next prompts go the gateway's way."""
        if api_key:
            self.known.pop(key_digest(api_key), None)

    def __call__(self, call: GatewayCall, api_key: str | None) -> dict | None:
        """Preprocessing's outputs for the call's prompt as JSON lists, or None where the gateway is to
        tokenize it."""
        if call.session_id is not None or call.slide_keep is not None or call.max_tokens is None or not api_key:
            return None
        if self.known.get(key_digest(api_key), 0.0) <= self.clock():
            return None
        values = gateway_values(call, "admit")  # the prompt exactly as the gateway would pass it on
        # a token-id prompt is only checked, not tokenized: each id counted as a character
        size = sum(len(values.get(k) or "") for k in ("text_input", "messages", "tools", "token_ids"))
        if size > self.max_bytes:
            return None
        try:
            out = self.preprocess(query=values.get("text_input"), request_output_len=call.max_tokens,
                                  stop_words=values.get("stop_words"), messages=values.get("messages"),
                                  tools=values.get("tools"), prompt_ids=values.get("token_ids"))
        except Exception:  # noqa: BLE001 - whatever it refuses, preprocessing answers for (in the gateway's order)
            return None
        return {name: array.tolist() for name, array in out.items()}
