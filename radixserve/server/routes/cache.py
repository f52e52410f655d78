"""Cache control routes: pin a prefix so it is never evicted, list pins, release them.

Owns: POST /cache/pin, DELETE /cache/pin, GET /cache/pins (parsing, the admin check, which
namespace a pin lives in). Does not know: how a pin is held (radixserve/sched/pins.py, in the
engine process).

Admin only when keys are configured (`--admin-key`). A pin lives in one cache namespace: the
shared one with --shared-cache or without keys; otherwise the namespace of `tenant_key` (the
API key whose requests should hit the pinned prefix), default the caller's own.
"""

from __future__ import annotations

import uuid
from typing import Any

from aiohttp import web

from radixserve.api.fields import bad, check_fields, get_float, parse_token_ids
from radixserve.ipc.messages import ListPinsMsg, PinMsg, UnpinMsg
from radixserve.server.app_state import STATE_KEY, ServerState, read_json, request_caller
from radixserve.server.error_responses import APIError, json_response

PIN_FIELDS = frozenset({"text", "input_ids", "ttl", "tenant_key"})
UNPIN_FIELDS = frozenset({"pin_id", "text", "input_ids", "tenant_key"})
MAX_TTL_S = 30 * 24 * 3600.0


def _require_admin(request: web.Request, state: ServerState) -> None:
    if not state.auth.enabled:
        return
    if not request_caller(request).admin:  # auth.py compared the key in constant time
        raise APIError(403, "cache pins need the admin key (--admin-key)",
                       code="admin_key_required")


async def _prefix(state: ServerState, body: dict[str, Any]) -> list[int]:
    has_text, has_ids = body.get("text") is not None, body.get("input_ids") is not None
    if has_text == has_ids:
        raise bad("exactly one of 'text' and 'input_ids' is required", "text")
    if has_text:
        if not isinstance(body["text"], str) or not body["text"]:
            raise bad("'text' must be a non-empty string", "text")
        return await state.encode(body["text"])
    ids = parse_token_ids(body["input_ids"], "input_ids")
    if not ids:
        raise bad("'input_ids' must not be empty", "input_ids")
    return await state.encode(ids)  # checks the ids against the vocabulary


def _namespace(request: web.Request, state: ServerState, body: dict[str, Any]) -> str:
    tenant = body.get("tenant_key")
    if tenant is None:
        return request_caller(request).cache_salt
    if not isinstance(tenant, str) or not tenant:
        raise bad("'tenant_key' must be a non-empty string (an API key)", "tenant_key")
    return state.auth.cache_salt(tenant)


async def pin(request: web.Request) -> web.Response:
    state = request.app[STATE_KEY]
    _require_admin(request, state)
    state.ensure_ready()
    body = check_fields(await read_json(request), PIN_FIELDS)
    ttl = get_float(body, "ttl")
    if ttl is not None and not 0 < ttl <= MAX_TTL_S:
        raise bad(f"'ttl' must be in (0, {MAX_TTL_S:.0f}] seconds", "ttl")
    ids = await _prefix(state, body)
    msg = PinMsg(uuid.uuid4().hex, ids, _namespace(request, state, body), ttl)
    return json_response(await state.client.call(msg))


async def unpin(request: web.Request) -> web.Response:
    state = request.app[STATE_KEY]
    _require_admin(request, state)
    state.ensure_ready()
    body = check_fields(await read_json(request), UNPIN_FIELDS)
    pin_id = body.get("pin_id")
    if pin_id is not None:
        if not isinstance(pin_id, str) or len(body) != 1:
            raise bad("'pin_id' must be a string, given alone", "pin_id")
        msg = UnpinMsg(uuid.uuid4().hex, pin_id=pin_id)
    else:
        ids = await _prefix(state, body)
        msg = UnpinMsg(uuid.uuid4().hex, token_ids=ids, salt=_namespace(request, state, body))
    result = await state.client.call(msg)
    if not result.get("released"):
        raise APIError(404, "no such pin", param="pin_id", code="pin_not_found")
    return json_response(result)


async def list_pins(request: web.Request) -> web.Response:
    state = request.app[STATE_KEY]
    _require_admin(request, state)
    state.ensure_ready()
    return json_response(await state.client.call(ListPinsMsg(uuid.uuid4().hex)))


def add_cache_routes(app: web.Application) -> None:
    app.router.add_post("/cache/pin", pin)
    app.router.add_delete("/cache/pin", unpin)
    app.router.add_get("/cache/pins", list_pins)
