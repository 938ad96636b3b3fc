"""The choices of one request, built from the pieces of its stream (the direct path's or the gateway's):
per choice its text through its own stop matcher, its token count, its tokens' log probs; the echoed
prompt (completions' `echo`) in front of each. Streamed or not, the same pieces make the same choices.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from contracts.logprobs import TokenLogprob
from front.gateway_client import Piece
from front.openai_schema import Choice, Completion, GatewayCall
from front.stop import StopMatcher


@dataclass
class ChoiceState:
    index: int
    stop: StopMatcher
    parts: list[str] = field(default_factory=list)  # its text so far, after stop strings
    ended: str | None = None  # why its engine sequence ended (token-level requests: its own end piece)
    tokens: list[TokenLogprob] | None = None  # their log probs, when asked for
    started: bool = False  # its first chunk is out (streaming)
    sent: int = 0  # characters of its text streamed so far (completions' text_offset)


class Choices:
    def __init__(self, call: GatewayCall):
        self.call = call
        self.states: dict[int, ChoiceState] = {}
        self.prompt: list[TokenLogprob] | None = None  # the prompt's tokens (echo with log probs or token ids)

    def state(self, index: int) -> ChoiceState:
        s = self.states.get(index)
        if s is None:
            s = self.states[index] = ChoiceState(index, StopMatcher(self.call.stop),
                                                 tokens=[] if self.call.logprobs is not None else None)
        return s

    def push(self, piece: Piece) -> tuple[ChoiceState, str]:
        """Take a piece: (its choice, the text that may go out now)."""
        s = self.state(piece.index)
        if piece.prompt_logprobs is not None:
            self.prompt = piece.prompt_logprobs
        if piece.finish_reason and not piece.final:  # the last piece names the request's, not a choice's
            s.ended = piece.finish_reason
        if piece.logprobs and s.tokens is not None:
            s.tokens.extend(piece.logprobs)
        return s, self.text(s, piece.text)

    @staticmethod
    def text(s: ChoiceState, text: str) -> str:
        """A choice's new text through its stop matcher: the part that may go out now."""
        out = s.stop.push(text)
        s.parts.append(out)
        return out

    def flush(self) -> list[tuple[ChoiceState, str]]:
        """At the end: what each choice's stop matcher still held."""
        out = []
        for i in range(self.call.n):
            s = self.state(i)
            text = s.stop.finish()
            s.parts.append(text)
            out.append((s, text))
        return out

    def echo_text(self) -> str:
        if not self.call.echo:
            return ""
        if self.call.text is not None:
            return self.call.text
        return b"".join(t.bytes for t in self.prompt or []).decode("utf-8", errors="replace")

    def echo_logprobs(self) -> list[TokenLogprob]:
        """The prompt's entries that go before a choice's own (echo with log probs)."""
        return list(self.prompt or []) if self.call.echo and self.call.logprobs is not None else []

    def finish_reason(self, s: ChoiceState, last: Piece) -> str:
        """The reason the stream gave (contracts.generation.GeneratedCounts decided it, or an upstream did),
        unless the front's own stop string ended the choice first."""
        if s.stop.stopped:
            return "stop"
        return s.ended or last.finish_reason or "stop"

    def completion(self, last: Piece, made_calls=()) -> Completion:
        """Every choice, once the last piece is in and `flush` was called. With tools offered, a choice's
        text is parsed into its tool calls (front/tool_calls.py); `made_calls`: the choices whose stream
        sent calls already."""
        echo, choices = self.echo_text(), []
        for i in range(self.call.n):
            s = self.state(i)
            text = "".join(s.parts)
            tokens = None
            if s.tokens is not None:
                own = _within(s.tokens, len(text.encode("utf-8"))) if s.stop.stopped else s.tokens
                tokens = self.echo_logprobs() + own
            reason, tool_calls = self.finish_reason(s, last), None
            if self.call.tool_plan is not None and text:
                content, tool_calls = self.call.tool_plan.parse(text)
                text = content or ""
            if (tool_calls or i in made_calls) and reason == "stop":
                reason = "tool_calls"
            choices.append(Choice(i, echo + text, reason, tokens, len(echo), tool_calls or None))
        return Completion(choices, last.model_used or self.call.model, last.prompt_tokens, last.completion_tokens)


def _within(tokens: list[TokenLogprob], size: int) -> list[TokenLogprob]:
    """The tokens that make the first `size` bytes of the text (a stop string cut the rest off)."""
    out, seen = [], 0
    for t in tokens:
        if seen >= size and t.bytes:
            break
        out.append(t)
        seen += len(t.bytes)
    return out
