"""A server under test on loopback: started on a free port, health-waited, stopped by its handle.

Owns: SystemSpec (argv, environment, health path, extra request body of one system) and
ServerProcess (the subprocess in its own session, its log, its health wait, and stopping it
with everything it spawned). Does not know: which systems exist (bench.common.peers), what
is sent to them, or how figures are read.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from bench.common.client import BenchError

REPO_ROOT = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class SystemSpec:
    name: str
    argv: tuple[str, ...]  # "{port}" is replaced by the chosen port
    env: dict[str, str] = field(default_factory=dict)
    health_path: str = "/health"
    startup_timeout_s: float = 600.0
    extra_body: Mapping[str, Any] = field(default_factory=dict)  # sent with every request
    cwd: str = str(REPO_ROOT)


def free_port() -> int:
    """A port the kernel just handed out on loopback (racy by nature; retried on failure)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class ServerProcess:
    """One system under test: started, health-waited, and stopped by its own handle."""

    def __init__(self, spec: SystemSpec, log_path: Path) -> None:
        self.spec, self.log_path = spec, log_path
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen[bytes] | None = None
        self._log: IO[bytes] | None = None

    def __enter__(self) -> ServerProcess:
        argv = [a.replace("{port}", str(self.port)) for a in self.spec.argv]
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = open(self.log_path, "wb")  # noqa: SIM115 - closed in __exit__
        # Its own session (process group), so stopping it also stops the engine processes it
        # spawned (radixserve's engine, vLLM's EngineCore) and leaves nothing behind.
        self.proc = subprocess.Popen(argv, stdout=self._log, stderr=subprocess.STDOUT,
                                     cwd=self.spec.cwd, env={**os.environ, **self.spec.env},
                                     start_new_session=True)
        try:
            self._wait_healthy()
        except BaseException:
            self.__exit__()
            raise
        return self

    def _wait_healthy(self) -> None:
        assert self.proc is not None
        deadline = time.monotonic() + self.spec.startup_timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise BenchError(f"{self.spec.name} exited with {self.proc.returncode} while "
                                 f"starting; see {self.log_path}")
            try:
                with urllib.request.urlopen(self.base_url + self.spec.health_path, timeout=2):
                    return
            except (urllib.error.URLError, OSError):
                time.sleep(0.5)
        raise BenchError(f"{self.spec.name} not healthy after {self.spec.startup_timeout_s:.0f}"
                         f" s; see {self.log_path}")

    def __exit__(self, *exc: object) -> None:
        if self.proc is not None:
            self._signal_group(signal.SIGTERM)  # graceful first: servers flush and exit
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
            self._signal_group(signal.SIGKILL)  # whatever it spawned and left running
        if self._log is not None:
            self._log.close()

    def _signal_group(self, sig: signal.Signals) -> None:
        assert self.proc is not None
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, sig)  # the group this handle created, nothing else
