"""GET / DELETE /v1/responses/{id} and GET /v1/responses/{id}/input_items: stored responses.

Owns: these routes, the 404 every miss gets (never stored, `store: false`, dropped by the
bounded store, deleted, or created by another API key: all look alike, so a key learns nothing
about another's ids), the caller's view of the store (`history_for`, what
`previous_response_id` reads) and the `X-Response-Id` header a stored response carries (the
router keeps a chain on the replica that holds it). Does not know: how a Response is made
(responses.py), the store's bound (radixserve/api/response_store.py).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from aiohttp import web

from radixserve.api.response_store import ResponseStore, StoredResponse, list_items
from radixserve.server.app_state import STATE_KEY, request_caller
from radixserve.server.error_responses import APIError, json_response

RESPONSE_ID_HEADER = "X-Response-Id"


def _missing(response_id: str, param: str | None = None, what: str = "Response") -> APIError:
    return APIError(404, f"{what} with id '{response_id}' not found.", param=param,
                    code="response_not_found")


def history_for(store: ResponseStore, owner: str) -> Callable[[str], list[dict[str, Any]]]:
    """previous_response_id -> the conversation it continues (404 when not the caller's)."""
    def history(response_id: str) -> list[dict[str, Any]]:
        stored = store.get(owner, response_id)
        if stored is None:
            raise _missing(response_id, "previous_response_id", "Previous response")
        return stored.conversation

    return history


def _stored(request: web.Request) -> tuple[ResponseStore, str, StoredResponse]:
    store = request.app[STATE_KEY].responses
    owner = request_caller(request).name
    response_id = request.match_info["response_id"]
    stored = store.get(owner, response_id)
    if stored is None:
        raise _missing(response_id)
    return store, owner, stored


async def get_response(request: web.Request) -> web.Response:
    if request.query.get("stream", "false") != "false":
        raise APIError(400, "replaying a stored response as a stream is not supported",
                       param="stream")
    return json_response(_stored(request)[2].body)


async def delete_response(request: web.Request) -> web.Response:
    store, owner, stored = _stored(request)
    store.delete(owner, stored.body["id"])
    return json_response({"id": stored.body["id"], "object": "response", "deleted": True})


async def input_items(request: web.Request) -> web.Response:
    return json_response(list_items(_stored(request)[2].input_items, dict(request.query)))


def add_stored_response_routes(app: web.Application) -> None:
    app.router.add_get("/v1/responses/{response_id}", get_response)
    app.router.add_delete("/v1/responses/{response_id}", delete_response)
    app.router.add_get("/v1/responses/{response_id}/input_items", input_items)
