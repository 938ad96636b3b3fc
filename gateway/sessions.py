"""Server-side conversations: chat sessions, and the objects of the Responses and Conversations APIs. The
gateway keeps a chat conversation under (tenant, session id), so a client sends only its new messages each
turn; and, for the front, a stored response (its object and the conversation up to it) under (tenant,
response id), which a next request names as its `previous_response_id` (front/responses_api.py), and a
conversation's items under (tenant, conversation id) (front/conversations_api.py).

A chat request with a `session_id` (request parameter; the front takes it from the body's `session_id`
or the `x-session-id` header) is served with the stored conversation followed by the new messages (a new
system message replaces the stored one). When that is over the window (the tenant's `max_context_tokens`
and the engine's, less `max_tokens`), the `sliding_window` policy drops the oldest turns, whole turns from
a user message on, and always keeps the system prompt and the new messages. When the answer succeeds,
the new messages and the answer are appended and the conversation is stored again with the session's TTL
(each turn renews it). What is stored is bounded (`max_messages`, `max_bytes`): past either, the oldest
non-system messages go.

Sessions live in Redis when the gateway has one (`redis_url`; every replica serves every session), else
in the gateway process. The key is a SHA-256 digest of (tenant, session id): another tenant using the same
id has a different, empty session and can neither read nor change this one. Concurrent turns of one
session are answered from the history each read, and all stored: each is written over the version it read
(the store's compare and set), or after the turns stored since (in the order they end).
"""
from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Callable
from dataclasses import dataclass

from gateway.kv_store import MemoryKV, RedisKV
from contracts.errors import ServingError, invalid
from contracts.tensors import STORED_KINDS, StoredKind, stored_revision

# reads a rewrite (an append, a session's turn) makes before it gives up to writes that keep coming between
# its read and its write
WRITE_TRIES = 64
CONTEXT_POLICIES = ("sliding_window",)  # summarization by the model is not built (docs/sessions.md)
SESSION_ID = re.compile(r"[A-Za-z0-9._:-]{1,128}")


class SessionPolicyError(ValueError):
    pass


@dataclass(frozen=True)
class SessionPolicy:
    """A tenant's `sessions:` settings (on, with these defaults, unless `sessions: false`)."""
    ttl_s: float = 3600.0
    max_messages: int = 256
    max_bytes: int = 256 * 1024
    context_policy: str = "sliding_window"
    kv_priority: int = 80  # the engine's retention priority for the session's KV (0-100; others get 35)


def parse_session_policy(where: str, raw) -> SessionPolicy | None:
    if raw is None or raw is True:
        return SessionPolicy()
    if raw is False:
        return None
    if not isinstance(raw, dict):
        raise SessionPolicyError(f"{where}: must be true, false or a mapping")
    known = {"enabled", "ttl_s", "max_messages", "max_bytes", "context_policy", "kv_priority"}
    unknown = set(raw) - known
    if unknown:
        raise SessionPolicyError(f"{where}: unknown field(s) {', '.join(sorted(unknown))}")
    if raw.get("enabled", True) is False:
        return None
    values = {}
    for name in ("ttl_s", "max_messages", "max_bytes"):
        v = raw.get(name, getattr(SessionPolicy, name))
        if isinstance(v, bool) or not isinstance(v, (int, float)) or v <= 0 \
                or (name != "ttl_s" and not isinstance(v, int)):
            raise SessionPolicyError(f"{where}.{name}: must be a positive {'number' if name == 'ttl_s' else 'integer'}, "
                                     f"got {v!r}")
        values[name] = v
    policy = raw.get("context_policy", "sliding_window")
    if policy not in CONTEXT_POLICIES:
        raise SessionPolicyError(f"{where}.context_policy: must be one of {', '.join(CONTEXT_POLICIES)}, got "
                                 f"{policy!r} (summarization is not available)")
    priority = raw.get("kv_priority", SessionPolicy.kv_priority)
    if isinstance(priority, bool) or not isinstance(priority, int) or not 0 <= priority <= 100:
        raise SessionPolicyError(f"{where}.kv_priority: must be an integer in [0, 100], got {priority!r}")
    return SessionPolicy(float(values["ttl_s"]), values["max_messages"], values["max_bytes"], policy, priority)


def kv_retention(policy: SessionPolicy) -> tuple[int, int]:
    """(priority, duration in ms) of a session turn's KV in the engine: the whole prompt and the answer,
    kept ahead of other prefixes for as long as the session lives (TensorRT-LLM's retention inputs)."""
    return policy.kv_priority, min(int(policy.ttl_s * 1000), 2**31 - 1)


def check_session_id(session_id: str) -> str:
    if not SESSION_ID.fullmatch(session_id):
        raise invalid("session_id", "must be 1 to 128 characters of letters, digits, '.', '_', ':' or '-'")
    return session_id


def merge(history: list[dict], new: list[dict]) -> list[dict]:
    """The conversation to answer: the stored one, then the new messages; a new system prompt replaces the old."""
    if any(m.get("role") == "system" for m in new):
        history = [m for m in history if m.get("role") != "system"]
    return history + new


def bound(messages: list[dict], policy: SessionPolicy) -> list[dict]:
    """What is stored: the oldest non-system messages dropped until within max_messages and max_bytes."""
    kept = list(messages)

    def size(ms):
        return len(json.dumps(ms, separators=(",", ":")).encode())

    while len(kept) > policy.max_messages or size(kept) > policy.max_bytes:
        oldest = next((i for i, m in enumerate(kept) if m.get("role") != "system"), None)
        if oldest is None or len(kept) <= 1:
            break
        del kept[oldest]
    return kept


async def fit_window(messages: list[dict], n_new: int, budget: int, count) -> list[dict]:
    """The sliding window: the conversation with its oldest turns dropped until `await count(messages)`
    (prompt tokens) is at most `budget`. Cuts fall on user messages, so a turn goes whole; system
    messages and the last `n_new` messages (this turn's) always stay. When even the shortest cut is over
    the budget, that cut is returned and the caller's own window check refuses it."""
    if await count(messages) <= budget:
        return messages
    system = [m for m in messages if m.get("role") == "system"]
    rest = [m for m in messages if m.get("role") != "system"]
    first_new = max(0, len(rest) - n_new)
    cuts = [i for i in range(1, first_new + 1) if i == first_new or rest[i].get("role") == "user"]
    if not cuts:
        return messages
    lo, hi = 0, len(cuts) - 1  # the smallest cut that fits; more dropped means fewer tokens
    while lo < hi:
        mid = (lo + hi) // 2
        if await count(system + rest[cuts[mid]:]) <= budget:
            hi = mid
        else:
            lo = mid + 1
    return system + rest[cuts[lo]:]


@dataclass
class Turn:
    """One request of a session: what to store when the answer succeeds (its messages go after the session
    as it is stored then)."""
    tenant: str
    session_id: str
    policy: SessionPolicy
    new: list[dict]  # this request's own messages


def store_unavailable() -> ServingError:
    return ServingError("unavailable", "the conversation store is not answering", retry_after=1.0)


class TenantDocuments:
    """JSON objects kept under (tenant, id) in the gateway's store (gateway/kv_store.py). The key is a SHA-256
    digest of (tenant, id) under a prefix of the kind's own, and what is read back must name the tenant it
    was stored for: another tenant using the same id finds nothing."""

    def __init__(self, store: MemoryKV | RedisKV, prefix: str):
        self.store = store
        self.prefix = prefix

    def _key(self, tenant: str, doc_id: str) -> str:
        return self.prefix + hashlib.sha256(f"{tenant}\0{doc_id}".encode()).hexdigest()

    async def get(self, tenant: str, doc_id: str) -> dict | None:
        """The stored object, or None when there is none (never made, expired or deleted)."""
        return (await self._read(tenant, doc_id))[1]

    async def _read(self, tenant: str, doc_id: str) -> tuple[bytes | None, dict | None]:
        """What the store holds under the key, and the object it is when it is this tenant's."""
        try:
            raw = await self.store.get(self._key(tenant, doc_id))
        except Exception:  # noqa: BLE001 - without what is stored the answer would be out of context
            raise store_unavailable() from None
        if raw is None:
            return None, None
        try:
            data = json.loads(raw)
        except ValueError:
            return raw, None
        if not isinstance(data, dict) or data.get("tenant") != tenant:
            return raw, None
        return raw, data

    @staticmethod
    def _encoded(tenant: str, doc: dict) -> bytes:
        return json.dumps({**doc, "tenant": tenant}, separators=(",", ":")).encode()

    async def put(self, tenant: str, doc_id: str, doc: dict, ttl_s: float) -> None:
        await self.store.set(self._key(tenant, doc_id), self._encoded(tenant, doc), ttl_s)

    async def rewrite(self, tenant: str, doc_id: str, change: Callable[[dict | None], dict], ttl_s: float) -> None:
        """`change(the stored object, None if there is none)` written only over what the store held when it
        was read (its compare and set), read and changed again when another write came between, in this
        gateway or another replica over Redis: concurrent writers all keep their change."""
        for _ in range(WRITE_TRIES):
            raw, doc = await self._read(tenant, doc_id)
            if await self.store.replace(self._key(tenant, doc_id), raw, self._encoded(tenant, change(doc)), ttl_s):
                return
        raise ServingError("unavailable", f"{doc_id!r} kept changing while it was written ({WRITE_TRIES} tries)",
                           retry_after=0.1)

    async def delete(self, tenant: str, doc_id: str) -> bool:
        try:
            return await self.store.delete(self._key(tenant, doc_id))
        except Exception:  # noqa: BLE001
            raise store_unavailable() from None


class Sessions(TenantDocuments):
    def __init__(self, store: MemoryKV | RedisKV):
        super().__init__(store, "llm:session:")

    async def load(self, tenant: str, session_id: str) -> list[dict] | None:
        """The stored conversation, or None when there is none (never made, expired or deleted)."""
        return _messages(await self.get(tenant, session_id))

    async def save(self, turn: Turn, answer: str) -> None:
        """The turn's messages and answer after the session as it is stored now: what the turn was answered
        from, or that and the turns stored since (concurrent turns are all kept, in the order they end)."""
        def after(stored: dict | None) -> dict:
            history = _messages(stored) or []
            return {"messages": bound(merge(history, turn.new) + [{"role": "assistant", "content": answer}],
                                      turn.policy)}
        await self.rewrite(turn.tenant, turn.session_id, after, turn.policy.ttl_s)


def _messages(stored: dict | None) -> list[dict] | None:
    return stored["messages"] if stored is not None and isinstance(stored.get("messages"), list) else None


class StoredObjects(TenantDocuments):
    """The objects the front keeps here, of one kind (contracts/tensors.py STORED_KINDS): a stored response
    ({response, input, items}) or a conversation ({conversation, items}), kept with the tenant's session TTL
    and within its max_bytes. The front makes them; the gateway checks their form and size and whose they are."""

    def __init__(self, store: MemoryKV | RedisKV, kind: StoredKind):
        super().__init__(store, f"llm:{kind.name}:")
        self.kind = kind

    def check_id(self, object_id: str | None) -> str:
        if object_id is None or not self.kind.id_form.fullmatch(object_id):
            raise invalid(self.kind.id_field, f"must be a {self.kind.name} id ({self.kind.id_form.pattern})")
        return object_id

    async def save(self, tenant: str, object_id: str, doc, policy: SessionPolicy, revision: str | None = None) -> bool:
        """Stored; with a `revision` (contracts/tensors.py stored_revision) only over that version of the
        object: False (nothing written) when it has changed since, so the front reads it again (a 404 when
        there is none)."""
        self._check(doc, policy)
        if revision is None:
            await self.put(tenant, object_id, doc, policy.ttl_s)
            return True
        raw, current = await self._read(tenant, object_id)
        return stored_revision(self._parts(object_id, current)) == revision and await self.store.replace(
            self._key(tenant, object_id), raw, self._encoded(tenant, doc), policy.ttl_s)

    def _parts(self, object_id: str, stored: dict | None) -> dict:
        """The stored object's parts (a 404 naming the kind's id when there is none)."""
        if stored is None:
            raise ServingError("not_found", f"no {self.kind.name} {object_id!r}", field=self.kind.id_field)
        return {part: stored[part] for part in self.kind.parts}

    def _check(self, doc, policy: SessionPolicy) -> None:
        """Refused (400 naming the kind) unless it is the kind's parts (lists, but the first, an object) and
        within the policy's max_bytes."""
        parts, name = self.kind.parts, self.kind.name
        if not (isinstance(doc, dict) and set(doc) == set(parts) and isinstance(doc[parts[0]], dict)
                and all(isinstance(doc[p], list) for p in parts[1:])):
            raise invalid(name, f"a stored {name} is {{{', '.join(parts)}}}")
        size = len(json.dumps(doc, separators=(",", ":")).encode())
        if size > policy.max_bytes:
            raise invalid(name, f"the {name} and its items are {size} bytes, over the tenant's {policy.max_bytes} "
                          "(sessions.max_bytes)")

    async def append(self, tenant: str, object_id: str, added, policy: SessionPolicy) -> None:
        """`added` ({"items": [...]}) after the stored object's items (`rewrite`: appends at once all keep
        their items). Not found: a 404 naming the kind's id."""
        last = self.kind.parts[-1]
        if not (isinstance(added, dict) and set(added) == {last} and isinstance(added[last], list)):
            raise invalid(self.kind.name, f"an append is {{{last}: [...]}}")

        def with_added(stored: dict | None) -> dict:
            doc = self._parts(object_id, stored)
            doc[last] = doc[last] + added[last]
            self._check(doc, policy)
            return doc
        await self.rewrite(tenant, object_id, with_added, policy.ttl_s)


def stored_objects(store: MemoryKV | RedisKV) -> dict[str, StoredObjects]:
    return {name: StoredObjects(store, kind) for name, kind in STORED_KINDS.items()}
