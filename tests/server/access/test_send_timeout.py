"""Clients that stop reading: a stream whose client left ends quietly, and a large
non-streaming answer the client does not take is dropped after --send-timeout (aiohttp alone
would wait for ever, holding the connection and the body)."""

from __future__ import annotations

import asyncio
import logging
import socket
from collections.abc import AsyncGenerator
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web
from aiohttp.test_utils import make_mocked_request

from radixserve.server import sse
from tests.server.test_app import GREEDY, TOKENIZER, serve
from tests.server.test_bounds import post_slow_reader
from tests.waiting import wait_until


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("fake_model")
    TOKENIZER.save_pretrained(path)
    return path


async def test_client_gone_mid_stream_ends_the_stream_quietly(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A write to a client that left raises ConnectionResetError (aiohttp: "Cannot write to
    closing transport"): the events are closed (aborting the engine work) and the handler
    returns, so aiohttp logs no "Error handling request" traceback for it."""
    closed: list[bool] = []

    async def events() -> AsyncGenerator[dict[str, int], None]:
        try:
            for i in range(10):
                yield {"i": i}
        finally:
            closed.append(True)

    sent: list[bytes] = []

    async def send_within(request: Any, resp: Any, data: bytes) -> None:
        if sent:
            raise ConnectionResetError("Cannot write to closing transport")
        sent.append(data)

    monkeypatch.setattr(sse, "send_within", send_within)
    resp = await sse.write_sse(make_mocked_request("POST", "/v1/completions"), events())
    assert resp.status == 200 and len(sent) == 1 and closed == [True]


def small_send_buffers(app: web.Application) -> None:
    """The server's kernel send buffer kept small (loopback's grows to megabytes), so that a
    body the client does not read stays in the server's own write buffer."""
    async def shrink(request: web.Request, response: web.StreamResponse) -> None:
        sock = request.transport.get_extra_info("socket") if request.transport else None
        if sock is not None:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)

    app.on_response_prepare.append(shrink)


async def test_stalled_reader_of_a_large_json_response_is_dropped(
        model_dir: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Non-streaming: the whole body is handed to aiohttp at once, and its write waits for the
    client. One that never reads would hold the connection and the body's memory for ever;
    after --send-timeout without progress the connection is dropped, quietly."""
    body = {"prompt": ["abcdefgh" * 8] * 2, "max_tokens": 400, "n": 4, "logprobs": 5,
            **GREEDY}  # 8 choices x 400 tokens with logprobs: ~100 kB of JSON
    async with serve(model_dir, send_timeout=0.3, app_hook=small_send_buffers) as tc:
        assert tc.server.port is not None and tc.server.runner is not None
        server = tc.server.runner.server
        assert server is not None
        before = set(server.connections)  # the test client's own keep-alive connection
        sock = await post_slow_reader(tc.server.port, "/v1/completions", body)
        loop = asyncio.get_running_loop()
        await wait_until(lambda: len(set(server.connections) - before) == 1, what="connected")
        (ours,) = set(server.connections) - before
        first = await loop.sock_recv(sock, 64)  # the status line came: the body is being sent
        assert first.startswith(b"HTTP/1.1 200 OK")
        # ... and then never reads: dropped after the send timeout.
        await wait_until(lambda: ours not in server.connections, timeout=60,
                         what="the stalled reader dropped")
        sock.close()
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], caplog.text
