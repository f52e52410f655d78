"""A request's deadline: --request-timeout (or the request's own), as a time on the loop's clock.

Owns: when a request's outputs are cut off (the tightest of the server's and the request's
timeouts, counted from its arrival) and the APIError(408) that says so. The waiting itself,
and closing the request's event stream (which aborts its engine requests, so the engine frees
their pages), are ServerState.outputs's. Does not know: routes, the engine.
"""

from __future__ import annotations

import asyncio
import time

from radixserve.api.errors import APIError


def deadline_at(limit: float | None, arrival: float) -> float | None:
    """The event loop's time at which a request that arrived at `arrival` (perf_counter) runs
    out of its `limit` seconds; None without a limit."""
    if limit is None:
        return None
    return asyncio.get_running_loop().time() + limit - (time.perf_counter() - arrival)


def timeout_error(limit: float) -> APIError:
    return APIError(408, f"the request did not finish within its {limit:g} s timeout; it was "
                         "aborted", code="request_timeout")
