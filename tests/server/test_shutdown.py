"""Stopping `radixserve serve` as `make serve` is stopped: SIGTERM to its whole process group
(the engine process gets it too) leaves no leaked semaphore behind."""

from __future__ import annotations

import signal
from pathlib import Path

from tests.server_proc import running_server


def test_sigterm_to_the_process_group_leaks_no_semaphore(tiny_llama: Path,
                                                         tmp_path: Path) -> None:
    with running_server(tiny_llama, tmp_path / "server.log", new_session=True) as server:
        code = server.stop_group(signal.SIGTERM)
        out = server.output()
    assert code == 0, out
    assert "leaked semaphore" not in out, out
