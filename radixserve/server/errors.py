"""HTTP error types and the OpenAI error body.

Owns: APIError (a typed, user-facing HTTP error), the `{"error": {...}}` JSON shape, and the
mapping from the engine's InvalidRequestError. Does not know: routes, the engine client.
"""

from __future__ import annotations

from typing import Any

import orjson
from aiohttp import web

from radixserve.types import InvalidRequestError

_TYPE_BY_STATUS = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    409: "conflict_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    503: "service_unavailable",
}


class APIError(Exception):
    """An error the client should see as-is: status, message and the parameter at fault."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers or {}

    @classmethod
    def from_invalid(cls, err: InvalidRequestError) -> APIError:
        return cls(err.status, str(err), param=err.param)

    @property
    def body(self) -> dict[str, Any]:
        return error_body(self.status, self.message, param=self.param, code=self.code)


def error_body(
    status: int, message: str, *, param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    fallback = "invalid_request_error" if status < 500 else "server_error"
    err_type = _TYPE_BY_STATUS.get(status, fallback)
    return {"error": {"message": message, "type": err_type, "param": param, "code": code}}


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
