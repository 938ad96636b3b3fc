"""The Conversations API's stored object (front/conversations_api.py), without a server: made, changed and
read as OpenAI's API says, every bad body a 400 naming its field; and the front's calls for stored objects
(front/stored_objects.py)."""
import asyncio

import pytest

from contracts.errors import ServingError
from front.conversations_api import added_items, item, items_list, new_conversation, with_metadata, without_item
from front.stored_objects import StoredObjects


def test_a_conversation_is_made_and_changed_whole():
    stored = new_conversation({"items": [{"role": "user", "content": "hi"}], "metadata": {"k": "v"}})
    conv = stored["conversation"]
    assert conv["id"].startswith("conv_") and conv["object"] == "conversation" and conv["metadata"] == {"k": "v"}
    assert [(i["type"], i["content"]) for i in stored["items"]] == [("message", [{"type": "input_text", "text": "hi"}])]
    assert new_conversation({})["items"] == [] and new_conversation({})["conversation"]["metadata"] == {}
    added = added_items({"items": [{"type": "function_call_output", "call_id": "c", "output": "x"}]})
    stored = {**stored, "items": stored["items"] + added}
    assert added[0]["id"].startswith("fco_")
    assert items_list(added)["first_id"] == items_list(added)["last_id"] == added[0]["id"]
    assert item(stored, added[0]["id"]) == added[0]
    assert [i["id"] for i in without_item(stored, added[0]["id"])["items"]] == [stored["items"][0]["id"]]
    assert with_metadata(stored, {"metadata": {"a": "b"}})["conversation"]["metadata"] == {"a": "b"}


@pytest.mark.parametrize("change,body,param", [
    ("new", {"items": "hi"}, "items"),
    ("new", {"items": [{"role": "user", "content": "hi"}] * 21}, "items"),
    ("new", {"items": [{"role": "robot", "content": "hi"}]}, "items[0].role"),
    ("new", {"metadata": {"k": 1}}, "metadata"),
    ("new", {"title": "x"}, "title"),
    ("items", {}, "items"),
    ("metadata", {}, "metadata"),
])
def test_bad_bodies_are_400s_naming_the_field(change, body, param):
    stored = new_conversation({})
    with pytest.raises(ServingError) as e:
        {"new": lambda: new_conversation(body), "items": lambda: added_items(body),
         "metadata": lambda: with_metadata(stored, body)}[change]()
    assert (e.value.kind, e.value.field) == ("invalid_argument", param)


def test_an_item_it_does_not_have_is_a_404_naming_item_id():
    with pytest.raises(ServingError) as e:
        without_item(new_conversation({}), "msg_nope")
    assert (e.value.kind, e.value.field) == ("not_found", "item_id")


def test_stored_objects_check_ids_first_name_the_clients_field_and_need_the_front_key_to_write():
    calls = []

    class Gateway:
        async def call(self, call, api_key, operation, parameters):
            calls.append((operation, parameters))
            raise ServingError("not_found", "no response 'resp_x'", field="response_id")

    stored = StoredObjects(Gateway(), None)
    with pytest.raises(ServingError) as e:  # not an id's form: refused before any gateway call
        asyncio.run(stored.get("k", "response", "resp_\ud800", "previous_response_id"))
    assert (e.value.kind, e.value.field, calls) == ("invalid_argument", "previous_response_id", [])
    with pytest.raises(ServingError) as e:
        asyncio.run(stored.get("k", "response", "resp_x", "previous_response_id"))
    assert (e.value.kind, e.value.field) == ("not_found", "previous_response_id")
    assert calls == [("response_get", {"response_id": "resp_x"})]
    with pytest.raises(ServingError) as e:
        asyncio.run(stored.delete("k", "response", "resp_x"))
    assert (e.value.kind, e.value.field) == ("not_found", "response_id") and calls[-1][0] == "response_delete"
    with pytest.raises(ServingError) as e:  # without the launcher's front key nothing is written
        asyncio.run(stored.put("k", "conversation", "conv_x", new_conversation({})))
    assert e.value.field == "conversation" and len(calls) == 2 and not stored.writable
