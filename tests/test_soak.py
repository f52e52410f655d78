"""The long soak (opt-in: `-m soak`, or RADIXSERVE_SOAK_S=<seconds>; 180 s by default): a
real server under the mixed load of tests/soak.py for minutes, ending with no page held, the
engine's integrity check passing and flat memory. RADIXSERVE_SOAK_MODEL picks another model
(e.g. smollm2-135m); the default is the tiny random Llama. The always-run short variant is
tests/server/test_fuzz.py::test_soak_short."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import pytest

from tests.server.test_fuzz import check_soak
from tests.server_proc import running_server
from tests.soak import soak

pytestmark = [pytest.mark.soak, pytest.mark.timeout(3600)]
KEY = "sk-soak-5e1f"


def test_soak(tiny_llama: Path, tmp_path: Path) -> None:
    seconds = float(os.environ.get("RADIXSERVE_SOAK_S") or 180)
    model = os.environ.get("RADIXSERVE_SOAK_MODEL") or str(tiny_llama)
    args = ["--kv-cache-tokens", "8192", "--max-tokens-cap", "64", "--api-key", KEY,
            "--max-queue", "64", "--request-timeout", "120"]
    with running_server(model, tmp_path / "server.log", args, key=KEY) as server:
        pids = {"api": server.proc.pid, "engine": server.info()["engine_pid"]}
        report = asyncio.run(soak(server.url, KEY, pids, duration_s=seconds, concurrency=8))
        check_soak(server, report)
        assert server.stop() == 0
    assert KEY not in server.output()
