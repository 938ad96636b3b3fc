"""OpenAI's Conversations API (`/v1/conversations`): a conversation is a list of Responses items the server
keeps; a `/v1/responses` request that names it (`conversation`) is answered with its items before its own
input, and its input and output are added to it.

What is stored is the gateway's (gateway/sessions.py StoredObjects, kind "conversation": per tenant, the
tenant's session TTL and max_bytes); this module makes and changes the stored object, {"conversation": the
conversation object, "items": its items}. Items are added in the gateway (`conversation_append`, a compare
and set there), so two responses in one conversation both keep theirs; a metadata update or an item's
removal is made here over the version read and written only over that version (front/stored_objects.py
`change`), so neither loses a response's items added meanwhile.
"""
from __future__ import annotations

import time
import uuid

from contracts.errors import ServingError, invalid
from front.responses_api import check_metadata, input_items

MAX_ITEMS_AT_ONCE = 20  # OpenAI's bound on the items a create or an add takes


def _new_items(body: dict, required: bool) -> list[dict]:
    items = body.get("items")
    if items is None and not required:
        return []
    if not isinstance(items, list) or not 1 <= len(items) <= MAX_ITEMS_AT_ONCE:
        raise invalid("items", f"must be a list of 1 to {MAX_ITEMS_AT_ONCE} items")
    return input_items(items, "items")[1]


def _known(body: dict, fields: set[str]) -> None:
    unknown = sorted(set(body) - fields)
    if unknown:
        raise invalid(unknown[0], "is not a field of this request")


def new_conversation(body: dict) -> dict:
    """POST /v1/conversations {items?, metadata?}: the object to store."""
    _known(body, {"items", "metadata"})
    conversation = {"id": "conv_" + uuid.uuid4().hex, "object": "conversation", "created_at": int(time.time()),
                    "metadata": check_metadata(body.get("metadata"))}
    return {"conversation": conversation, "items": _new_items(body, required=False)}


def with_metadata(stored: dict, body: dict) -> dict:
    """POST /v1/conversations/{id} {metadata}: the stored object with the new metadata."""
    _known(body, {"metadata"})
    if "metadata" not in body:
        raise invalid("metadata", "is required")
    return {**stored, "conversation": {**stored["conversation"], "metadata": check_metadata(body["metadata"])}}


def added_items(body: dict) -> list[dict]:
    """POST /v1/conversations/{id}/items {items}: the items to add (the gateway adds them)."""
    _known(body, {"items"})
    return _new_items(body, required=True)


def item(stored: dict, item_id: str) -> dict:
    for it in stored["items"]:
        if it.get("id") == item_id:
            return it
    raise ServingError("not_found", f"no item {item_id!r} in conversation {stored['conversation']['id']!r}",
                       field="item_id")


def without_item(stored: dict, item_id: str) -> dict:
    """DELETE /v1/conversations/{id}/items/{item_id}: the stored object without it (404 if it has none)."""
    item(stored, item_id)
    return {**stored, "items": [it for it in stored["items"] if it.get("id") != item_id]}


def items_list(items: list[dict]) -> dict:
    """The items a create or an add took, as OpenAI lists them."""
    return {"object": "list", "data": items, "first_id": items[0]["id"] if items else None,
            "last_id": items[-1]["id"] if items else None, "has_more": False}
