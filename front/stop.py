"""OpenAI `stop` strings on the text stream.

The engine also gets the stop strings (as token sequences, the `stop_words` contract) and normally ends
there itself; but a string can tokenize differently in context, and OpenAI leaves the stop string out of
the answer while TensorRT-LLM keeps the stop tokens. So the front cuts the text at the first stop
string it sees and, while streaming, holds back any tail that could still grow into one.
"""
from __future__ import annotations


class StopMatcher:
    def __init__(self, stops: list[str]):
        self.stops = [s for s in stops if s]
        self.longest = max((len(s) for s in self.stops), default=0)
        self.held = ""
        self.stopped = False

    def push(self, text: str) -> str:
        """New text in; the part that is safe to send out now."""
        if self.stopped:
            return ""
        if not self.stops:
            return text
        buf = self.held + text
        cut = min((i for i in (buf.find(s) for s in self.stops) if i >= 0), default=-1)
        if cut >= 0:
            self.stopped, self.held = True, ""
            return buf[:cut]
        keep = self._partial_tail(buf)
        self.held = buf[len(buf) - keep:] if keep else ""
        return buf[:len(buf) - keep]

    def finish(self) -> str:
        """End of generation: the held tail was never a stop string."""
        rest, self.held = ("" if self.stopped else self.held), ""
        return rest

    def _partial_tail(self, buf: str) -> int:
        """Length of the longest suffix of `buf` that is a proper prefix of some stop string."""
        for n in range(min(len(buf), self.longest - 1), 0, -1):
            tail = buf[-n:]
            if any(s.startswith(tail) for s in self.stops):
                return n
        return 0
