"""Stored-response affinity: a Responses chain goes to the replica that holds its response.

Owns: the table response id -> the replica that created it (LRU, `max_sessions` entries),
learnt from the `X-Response-Id` header a replica puts on every stored response; finding an
id the table does not know (this router restarted, or another router saw it) by asking the
replicas with the caller's own key; and the router's GET / DELETE /v1/responses/{id} and
.../input_items, which go to the owner (or to whichever replica answers other than 404). Ids
carry no replica: a replica that lost the response (restarted, dropped by its bounded store)
answers 404 itself, and so does the router when none has it.
Does not know: policies, prefix indexes, how POST requests are relayed (proxy/).
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from collections.abc import Iterable, Mapping

import aiohttp
import orjson
from aiohttp import web

RESPONSE_ID_HEADER = "X-Response-Id"  # radixserve/server/routes/stored_responses.py
PROBE_TIMEOUT_S = 5.0


class ResponseOwners:
    def __init__(self, max_entries: int) -> None:
        assert max_entries >= 1
        self.max_entries = max_entries
        self._owner: OrderedDict[str, str] = OrderedDict()  # least recently used first

    def __len__(self) -> int:
        return len(self._owner)

    def owner(self, response_id: str) -> str | None:
        url = self._owner.get(response_id)
        if url is not None:
            self._owner.move_to_end(response_id)
        return url

    def note(self, response_id: str, url: str) -> None:
        self._owner[response_id] = url
        self._owner.move_to_end(response_id)
        while len(self._owner) > self.max_entries:
            self._owner.popitem(last=False)

    def note_answer(self, headers: Mapping[str, str], url: str) -> None:
        """A replica's answer: remember the response it stored, if any."""
        response_id = headers.get(RESPONSE_ID_HEADER)
        if response_id:
            self.note(response_id, url)

    def forget_worker(self, url: str) -> None:
        for response_id in [r for r, u in self._owner.items() if u == url]:
            del self._owner[response_id]

    def order(self, response_id: str, urls: Iterable[str]) -> list[str]:
        """The replicas to ask for `response_id`: its owner first when known."""
        owner = self.owner(response_id)
        rest = [u for u in urls if u != owner]
        return rest if owner is None or owner not in set(urls) else [owner, *rest]

    async def locate(self, session: aiohttp.ClientSession, response_id: str,
                     urls: Iterable[str], authorization: str | None) -> str | None:
        """The replica holding `response_id` for this caller (asked in turn), learnt."""
        headers = {"Authorization": authorization} if authorization else {}
        timeout = aiohttp.ClientTimeout(total=PROBE_TIMEOUT_S)
        for url in self.order(response_id, urls):
            try:
                async with session.get(f"{url}/v1/responses/{response_id}", headers=headers,
                                       timeout=timeout) as resp:
                    await resp.read()
                    if resp.status == 200:
                        self.note(response_id, url)
                        return url
            except (aiohttp.ClientError, asyncio.TimeoutError):
                continue
        return None


async def stored_response(request: web.Request, session: aiohttp.ClientSession,
                          owners: ResponseOwners, urls: list[str]) -> web.Response:
    """GET / DELETE /v1/responses/{id}[/input_items]: the first answer other than 404,
    asking the owner first; 404 (the last replica's) when none holds it."""
    response_id = request.match_info["response_id"]
    headers = {k: v for k, v in request.headers.items() if k.lower() == "authorization"}
    timeout = aiohttp.ClientTimeout(total=PROBE_TIMEOUT_S)
    last: web.Response | None = None
    for url in owners.order(response_id, urls):
        try:
            async with session.request(request.method, f"{url}{request.rel_url}",
                                       headers=headers, timeout=timeout) as resp:
                body = await resp.read()
                answer = web.Response(status=resp.status, body=body,
                                      content_type=resp.content_type)
        except (aiohttp.ClientError, asyncio.TimeoutError):
            continue
        if resp.status != 404:
            if resp.status == 200 and request.method == "GET":
                owners.note(response_id, url)
            return answer
        last = answer
    if last is not None:
        return last
    error = {"message": f"Response with id '{response_id}' not found.",
             "type": "not_found_error", "param": None, "code": "response_not_found"}
    return web.Response(status=404, body=orjson.dumps({"error": error}),
                        content_type="application/json")
