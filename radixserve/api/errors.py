"""APIError, a typed user-facing error, and the OpenAI error body `{"error": {...}}`.

Owns: the error's status, message, parameter, code and extra headers, and the mapping from
a status to OpenAI's error `type`. Does not know: HTTP frameworks (server/error_responses.py turns an
APIError into an aiohttp response), the engine client's errors.
"""

from __future__ import annotations

from typing import Any

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
