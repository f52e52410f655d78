"""Stored responses (`store: true`): what `previous_response_id` and GET /v1/responses/{id} read.

Owns: ResponseStore, a bounded LRU of StoredResponse by response id (`--responses-store-size`;
the least recently created or read one is dropped first), the owner rule (a response is
visible only to the API key that created it: another key, reading or chaining, finds nothing,
exactly as for an id that never existed), the conversation items a chained turn continues
(the chain's input items and outputs, in order, so the next prompt is rendered exactly as a
request sending the whole history would render it, and the radix tree serves that history),
and input items as OpenAI lists them (ids given to items that had none).
Does not know: HTTP, the engine, how a Response is built (server/routes/responses.py).
"""

from __future__ import annotations

import uuid
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from radixserve.api.fields import bad

_PART_KIND = {"assistant": "output_text"}  # other roles' text parts are input_text


@dataclass(frozen=True)
class StoredResponse:
    owner: str  # the creating key's name ("" without keys)
    body: dict[str, Any]  # the Response object, as it was returned
    input_items: tuple[dict[str, Any], ...]  # the whole chain's items this response answered

    @property
    def conversation(self) -> list[dict[str, Any]]:
        """The items a chained request continues: the input items, then this output."""
        return [*self.input_items, *self.body["output"]]


def normalize_input(value: Any) -> list[dict[str, Any]]:
    """`input` as a list of items with ids and text parts, as OpenAI lists them back; the
    chat messages they amount to are unchanged (one text part is the string itself). Malformed
    input is left for api/responses.py to reject."""
    if isinstance(value, str):
        value = [{"role": "user", "content": value}]
    if not isinstance(value, list):
        return []
    items = []
    for item in value:
        if not isinstance(item, dict):
            return []
        out = dict(item)
        kind = out.setdefault("type", "message")
        if kind == "message" and isinstance(out.get("content"), str):
            part = _PART_KIND.get(out.get("role", ""), "input_text")
            out["content"] = [{"type": part, "text": out["content"]}]
        if "id" not in out:
            prefix = "msg" if kind == "message" else "fc" if kind == "function_call" else "fco"
            out["id"] = f"{prefix}_{uuid.uuid4().hex}"
        items.append(out)
    return items


class ResponseStore:
    """Bounded: at most `capacity` responses (0: nothing is kept)."""

    def __init__(self, capacity: int) -> None:
        assert capacity >= 0
        self.capacity = capacity
        self._items: OrderedDict[str, StoredResponse] = OrderedDict()

    def __len__(self) -> int:
        return len(self._items)

    def put(self, owner: str, body: dict[str, Any],
            input_items: list[dict[str, Any]]) -> None:
        if self.capacity == 0:
            return
        self._items[body["id"]] = StoredResponse(owner, body, tuple(input_items))
        self._items.move_to_end(body["id"])
        while len(self._items) > self.capacity:
            self._items.popitem(last=False)

    def get(self, owner: str, response_id: str) -> StoredResponse | None:
        """The response if it is stored and `owner` created it (a read counts as a use)."""
        stored = self._items.get(response_id)
        if stored is None or stored.owner != owner:
            return None
        self._items.move_to_end(response_id)
        return stored

    def delete(self, owner: str, response_id: str) -> bool:
        if self.get(owner, response_id) is None:
            return False
        del self._items[response_id]
        return True


def list_items(items: tuple[dict[str, Any], ...], query: dict[str, str]) -> dict[str, Any]:
    """GET .../input_items: OpenAI's list page (`order` desc by default, `limit` 1-100,
    default 20, `after` an item id)."""
    order = query.get("order", "desc")
    if order not in ("asc", "desc"):
        raise bad("'order' must be 'asc' or 'desc'", "order")
    try:
        limit = int(query.get("limit", "20"))
    except ValueError:
        limit = 0
    if not 1 <= limit <= 100:
        raise bad("'limit' must be an integer from 1 to 100", "limit")
    ordered = list(items) if order == "asc" else list(reversed(items))
    after = query.get("after")
    if after is not None:
        ids = [item.get("id") for item in ordered]
        if after not in ids:
            raise bad(f"'after': no input item with id {after!r}", "after")
        ordered = ordered[ids.index(after) + 1:]
    page = ordered[:limit]
    return {"object": "list", "data": page, "first_id": page[0]["id"] if page else None,
            "last_id": page[-1]["id"] if page else None, "has_more": len(ordered) > limit}
