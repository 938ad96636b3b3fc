"""KV retention priorities, as TensorRT-LLM's `KvCacheRetentionConfig` and its Triton inputs: token ranges of
the prompt (`retention_token_range_starts` / `_ends`, an end of -1 meaning the prompt's end) each with a
priority (0-100, higher is evicted later; 35 when none is given) and optionally a duration after which
the priority falls back to the default, and the same for the generated tokens (`retention_decode_priority`,
`retention_decode_duration_ms`).

The pool (block_pool.py) evicts a cached free block of the lowest priority first, least recently used among
equals. The gateway sends a high priority for session turns (gateway/sessions.py), so an idle session's
prefix stays in the pool while one-off prompts come and go; what is evicted anyway goes to the host tier
(host_tier.py) when there is one.
"""
from __future__ import annotations

from dataclasses import dataclass

DEFAULT_PRIORITY = 35  # TensorRT-LLM's KvCacheRetentionConfig default
MAX_PRIORITY = 100


@dataclass(frozen=True)
class Retention:
    ranges: tuple[tuple[int, int | None, int, float | None], ...]  # (start, end or None, priority, duration_s)
    decode_priority: int = DEFAULT_PRIORITY
    decode_duration_s: float | None = None

    def block_priority(self, start: int, end: int, prompt_len: int, now: float) -> tuple[int, float | None]:
        """(priority, expiry or None) of the block holding positions [start, end): the highest priority
        among the prompt ranges it overlaps, or the decode priority for a block past the prompt."""
        if start >= prompt_len:
            d = self.decode_duration_s
            return self.decode_priority, (now + d if d is not None else None)
        best, expires = DEFAULT_PRIORITY, None
        for s, e, p, d in self.ranges:
            e = prompt_len if e is None else e
            if s < end and start < e and p > best:
                best, expires = p, (now + d if d is not None else None)
        return best, expires


def parse_retention(starts, ends, priorities, durations_ms, decode_priority, decode_duration_ms):
    """A Retention from the request's inputs (lists of ints or None), or None when none is set; raises
    ValueError(field, message) for what upstream's backend refuses too (ranges of unequal lengths, a
    priority outside 0-100, an end before its start)."""
    if starts is None and decode_priority is None:
        return None
    starts = list(starts or [])
    for name, values in (("retention_token_range_ends", ends), ("retention_token_range_priorities", priorities)):
        if starts and (values is None or len(values) != len(starts)):
            raise ValueError(name, "must be given with retention_token_range_starts, one per range")
    if durations_ms is not None and len(durations_ms) != len(starts):
        raise ValueError("retention_token_range_durations_ms", "must have one value per range")
    ranges = []
    for i, s in enumerate(starts):
        e, p = int(ends[i]), int(priorities[i])
        d = None if durations_ms is None or int(durations_ms[i]) < 0 else int(durations_ms[i]) / 1000
        if s < 0 or (e != -1 and e <= s):
            raise ValueError("retention_token_range_ends", f"range {i}: [{s}, {e}) is empty or negative")
        if not 0 <= p <= MAX_PRIORITY:
            raise ValueError("retention_token_range_priorities", f"must be in [0, {MAX_PRIORITY}], got {p}")
        ranges.append((int(s), None if e == -1 else e, p, d))
    dp = DEFAULT_PRIORITY if decode_priority is None else int(decode_priority)
    if not 0 <= dp <= MAX_PRIORITY:
        raise ValueError("retention_decode_priority", f"must be in [0, {MAX_PRIORITY}], got {dp}")
    dd = None if decode_duration_ms is None or int(decode_duration_ms) < 0 else int(decode_duration_ms) / 1000
    return Retention(tuple(ranges), dp, dd)
