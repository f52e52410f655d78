"""Errors as aiohttp responses: an APIError's JSON body, and which exceptions clients see.

Owns: json_response / error_response (the `{"error": {...}}` body as an aiohttp response) and
to_api_error (the engine's InvalidRequestError and the engine client's failures as APIErrors).
APIError itself and the body's shape live in radixserve/api/errors.py (no aiohttp); they are
re-exported here for the routes. Does not know: routes, the engine client's internals.
"""

from __future__ import annotations

from typing import Any

import orjson
from aiohttp import web

from radixserve.api.errors import APIError as APIError
from radixserve.api.errors import error_body as error_body
from radixserve.types import InvalidRequestError


def json_response(data: Any, status: int = 200,
                  headers: dict[str, str] | None = None) -> web.Response:
    return web.Response(
        body=orjson.dumps(data), status=status, content_type="application/json", headers=headers
    )


def error_response(err: APIError) -> web.Response:
    return json_response(err.body, status=err.status, headers=err.headers)


def to_api_error(exc: BaseException) -> APIError | None:
    """The client-facing form of an error we expect; None for a bug (the caller logs a 500)."""
    # Imported here: errors.py must stay importable without the engine client (tests, router).
    from radixserve.ipc.client import EngineFailedError, EngineUnavailableError

    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, InvalidRequestError):
        return APIError.from_invalid(exc)
    if isinstance(exc, EngineUnavailableError):
        return APIError(503, str(exc), code="engine_unavailable")
    if isinstance(exc, EngineFailedError):
        return APIError(500, str(exc), code="engine_failed")
    return None
