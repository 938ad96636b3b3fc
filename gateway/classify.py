"""`model: "auto"` with `routing.auto_policy: classifier`: how hard a prompt is, by a clear rule, and the
cheapest eligible model able enough for it.

The rule (no model is run to decide, so it costs microseconds and an operator can predict it):
  level 3 (hard)   the prompt shows code: a code fence, or two or more code cues (def, class, import,
                   #include, SELECT ... FROM, a traceback, "refactor", "regex", "stack trace" ...)
  level 2 (medium) a reasoning cue (prove, derive, step by step, analyze, compare, explain why, design ...),
                   one code cue, or a prompt of at least `auto_long_prompt_tokens` tokens
  level 1 (easy)   anything else: short questions, chit-chat, rewording
A model's `capability` (1..3, routing.models) says which levels it serves. `auto` takes, among the models
the tenant may use, its tier is eligible for, whose context fits, whose price is under the tenant's
`auto_max_price_per_1k` and whose upstream's circuit is not open, the cheapest one whose capability is
at least the level (ties: the less capable, then local before upstream, then by name); when none is able
enough, the most capable of them.
"""
from __future__ import annotations

import json
import re

CODE_CUES = re.compile(
    r"(\bdef \w+\(|\bclass \w+[:(]|^\s*import \w+|#include|\bselect\b.+\bfrom\b|traceback|stack trace|"
    r"\bregex\b|\brefactor|\bfunction\s*\w*\(|\bcompile[sd]?\b|\bsegfault|\bsql\b|\bjson schema\b|=>|\{\s*$)",
    re.I | re.M)
REASONING_CUES = re.compile(
    r"\b(prove|proof|derive|step[- ]by[- ]step|analy[sz]e|compare|trade-?offs?|explain why|design|"
    r"plan|evaluate|critique|optimi[sz]e)\b", re.I)


def prompt_text(text, messages) -> str:
    """The words a client wrote: the prompt, or the text content of every chat message."""
    if text:
        return text.decode("utf-8", "replace") if isinstance(text, bytes) else str(text)
    if not messages:
        return ""
    try:
        msgs = json.loads(messages)
    except (ValueError, TypeError):
        return ""
    parts = []
    for m in msgs if isinstance(msgs, list) else []:
        content = m.get("content") if isinstance(m, dict) else None
        if isinstance(content, str):
            parts.append(content)
        elif isinstance(content, list):
            parts.extend(p.get("text", "") for p in content if isinstance(p, dict) and isinstance(p.get("text"), str))
    return "\n".join(parts)


def complexity(text: str, prompt_tokens: int, long_prompt_tokens: int) -> tuple[int, str]:
    """(level 1..3, why) by the rule above."""
    code = len(CODE_CUES.findall(text))
    if "```" in text or code >= 2:
        return 3, "code"
    if REASONING_CUES.search(text):
        return 2, "reasoning"
    if code == 1:
        return 2, "code cue"
    if prompt_tokens >= long_prompt_tokens:
        return 2, "long prompt"
    return 1, "simple"


def rank(candidates, level: int, tenant) -> list:
    """The candidates (ModelSpecs) in the order `auto` tries them."""
    able = sorted((c for c in candidates if c.capability >= level),
                  key=lambda c: (c.price_per_1k(tenant), c.capability, c.upstream is not None, c.name))
    rest = sorted((c for c in candidates if c.capability < level),
                  key=lambda c: (-c.capability, c.price_per_1k(tenant), c.upstream is not None, c.name))
    return able + rest
