"""Real `radixserve serve` processes for end-to-end tests: start on a free port, wait for
/health, talk to them, stop them by their handle, read their whole output.

Owns: process handling only. Does not know: what a test checks.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


@dataclass
class ServerProc:
    url: str
    proc: subprocess.Popen[bytes]
    log: Path
    key: str | None = None

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def get(self, path: str, timeout: float = 10.0) -> tuple[int, Any]:
        headers = {"Authorization": f"Bearer {self.key}"} if self.key else {}
        req = urllib.request.Request(self.url + path, headers=headers)
        try:
            with urllib.request.urlopen(req, timeout=timeout) as resp:
                return resp.status, orjson.loads(resp.read() or b"null")
        except urllib.error.HTTPError as err:
            return err.code, orjson.loads(err.read() or b"null")

    def info(self) -> dict[str, Any]:
        status, body = self.get("/server_info")
        assert status == 200, body
        result: dict[str, Any] = body
        return result

    def wait_healthy(self, timeout: float = 180.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited ({self.proc.returncode}):\n{self.output()}")
            with contextlib.suppress(OSError):
                if self.get("/health", timeout=2)[0] == 200:
                    return
            time.sleep(0.1)
        raise RuntimeError(f"server not healthy after {timeout}s:\n{self.output()}")

    def wait_idle(self, timeout: float = 60.0) -> dict[str, Any]:
        """The engine's stats once nothing runs, waits or holds a page (invariant 1 checked)."""
        deadline = time.monotonic() + timeout
        while True:
            s: dict[str, Any] = self.info()["stats"]
            assert s["kv_free_tokens"] + s["kv_cached_tokens"] + s["kv_held_tokens"] == \
                s["kv_total_tokens"], s
            if s["num_running"] == 0 and s["num_waiting"] == 0 and s["kv_held_tokens"] == 0:
                return s
            assert time.monotonic() < deadline, f"pages still held: {s}"
            time.sleep(0.05)

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 60.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        return self.proc.returncode

    def stop_group(self, sig: int = signal.SIGTERM, timeout: float = 60.0) -> int:
        """`sig` to the server's whole process group (as a terminal's Ctrl-C or `make serve`'s
        supervisor sends it: the engine process gets it too). Needs `new_session=True`."""
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, sig)
        code = self.stop(timeout=timeout)
        # The group's last processes (multiprocessing's resource tracker) write to the log as
        # they exit: wait until none is left, so output() is complete.
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                os.killpg(self.proc.pid, 0)
            except ProcessLookupError:
                break
            time.sleep(0.05)
        return code


@contextlib.contextmanager
def running_server(model: Path | str, log: Path, args: Sequence[str] = (),
                   key: str | None = None, env: dict[str, str] | None = None,
                   healthy: bool = True, new_session: bool = False) -> Iterator[ServerProc]:
    """`radixserve serve` on a free port, float32, one torch thread; stopped on exit.
    `new_session`: the server leads its own process group (for stop_group)."""
    port = free_port()
    cmd = [sys.executable, "-m", "radixserve", "serve", "--model", str(model), "--port",
           str(port), "--dtype", "float32", "--num-threads", "1", "--log-stats-interval",
           "3600", *args]
    with open(log, "wb") as sink:
        proc = subprocess.Popen(cmd, stdout=sink, stderr=subprocess.STDOUT,
                                env={**os.environ, **(env or {})},
                                start_new_session=new_session)
    server = ServerProc(f"http://127.0.0.1:{port}", proc, log, key)
    try:
        if healthy:
            server.wait_healthy()
        yield server
    finally:
        server.stop()


def start_all(stack: contextlib.ExitStack, specs: Sequence[tuple[Path | str, Path, Sequence[str]]]
              ) -> list[ServerProc]:
    """`running_server(model, log, args)` for each spec, entered on `stack` (stopped by it), all
    started before waiting for any: their start-ups overlap (a start is mostly one core's
    imports and loading)."""
    servers = [stack.enter_context(running_server(model, log, args, healthy=False))
               for model, log, args in specs]
    wait_all_healthy(servers)
    return servers


def wait_all_healthy(servers: Sequence[ServerProc], timeout: float = 180.0) -> None:
    """Each server started side by side gets the time it would have had started alone: the
    first waits for all the starts it overlaps (as much as the starts one by one would take)."""
    for server in servers:
        server.wait_healthy(timeout * len(servers))
