"""The objects of the Responses and Conversations APIs as the front reads and writes them: kept by the
gateway (gateway/sessions.py StoredObjects; operations `<kind>_get`, `<kind>_put`, `<kind>_delete` of
contracts/tensors.py STORED_KINDS), per tenant, written only with the launcher's front key."""
from __future__ import annotations

import json
from collections.abc import Callable

from contracts.errors import ServingError, invalid
from contracts.tensors import STORED_KINDS, stored_revision
from front.openai_schema import GatewayCall


NOT_WRITABLE = "this front stores nothing (it runs without the launcher's LLM_FRONT_KEY)"
# reads a change makes before it gives up to writes that keep coming between its read and its write
CHANGE_TRIES = 64


def check_stored_id(kind: str, value, field: str) -> str:
    """A stored object's id in its kind's form or a 400 naming `field` (before any gateway call: an id that
    is not one, a lone surrogate say, must not become a request parameter)."""
    form = STORED_KINDS[kind].id_form
    if not (isinstance(value, str) and form.fullmatch(value)):
        raise invalid(field, f"must be a {kind} id ({form.pattern})")
    return value


class StoredObjects:
    def __init__(self, gateway, front_key: str | None):
        self.gateway = gateway
        # the launcher's key of the front (LLM_FRONT_KEY): without it nothing can be written
        self.front_key = front_key

    @property
    def writable(self) -> bool:
        return self.front_key is not None

    async def get(self, api_key: str | None, kind: str, object_id, field: str | None = None) -> dict:
        """The caller's tenant's object (its kind's parts); a 404 naming `field` (default: the kind's id)."""
        return await self._call(api_key, kind, "get", object_id, field)

    async def put(self, api_key: str | None, kind: str, object_id: str, stored: dict,
                  revision: str | None = None) -> bool:
        """Stored; with a `revision`, only over that version (False when it changed since)."""
        if self.front_key is None:
            raise invalid(kind, NOT_WRITABLE)
        answer = await self._call(api_key, kind, "put", object_id, None,
                                  {"front_key": self.front_key, "stored_object": json.dumps(stored),
                                   **({"stored_revision": revision} if revision else {})})
        return answer.get("stored") is True

    async def change(self, api_key: str | None, kind: str, object_id: str, edit: Callable[[dict], dict]) -> dict:
        """The object read, `edit`ed and written over the version read, read again when another write (a
        response's items added, say) came between, so none is lost; the object as written."""
        for _ in range(CHANGE_TRIES):
            stored = await self.get(api_key, kind, object_id)
            changed = edit(stored)
            if await self.put(api_key, kind, object_id, changed, stored_revision(stored)):
                return changed
        raise ServingError("unavailable", f"the {kind} {object_id!r} kept changing while it was written "
                           f"({CHANGE_TRIES} tries)", retry_after=0.1)

    async def append(self, api_key: str | None, kind: str, object_id: str, items: list[dict]) -> None:
        """Items added to the object's in the gateway, none lost to another append (a 404 if it has none)."""
        if self.front_key is None:
            raise invalid(kind, NOT_WRITABLE)
        await self._call(api_key, kind, "append", object_id, None,
                         {"front_key": self.front_key, "stored_object": json.dumps({"items": items})})

    async def delete(self, api_key: str | None, kind: str, object_id) -> None:
        await self._call(api_key, kind, "delete", object_id)

    async def _call(self, api_key, kind: str, verb: str, object_id, field: str | None = None,
                    parameters: dict | None = None) -> dict:
        id_field = STORED_KINDS[kind].id_field
        field = field or id_field
        check_stored_id(kind, object_id, field)
        try:
            piece = await self.gateway.call(GatewayCall(), api_key, f"{kind}_{verb}",
                                            parameters={id_field: object_id, **(parameters or {})})
        except ServingError as e:
            if e.field == id_field and field != id_field:  # the id as the client named it
                e.message, e.field = e.message.replace(id_field, field, 1), field
            raise
        return json.loads(piece.text or "{}")
