"""The tiers through `radixserve serve` (tiny model, fp32): replica B serves a prefix that
replica A computed through --kv-shared-dir (no router), a restarted server on the same
--kv-offload-dir serves its first requests from what the last one left, and the tiers show in
/metrics, /server_info and /kv_events."""

from __future__ import annotations

import contextlib
import time
import urllib.request
from pathlib import Path
from typing import Any

import orjson
import pytest
import torch

from tests.server_proc import ServerProc, running_server, start_all

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


def prompt(seed: int, n: int = 300) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 250, (n,), generator=g).tolist()


def complete(server: ServerProc, ids: list[int]) -> tuple[list[int], int]:
    """Greedy completion of token ids: (the text's characters as codes, cached_tokens)."""
    body = orjson.dumps({"model": server.info()["model"], "prompt": ids, "max_tokens": 8,
                         "temperature": 0, "ignore_eos": True})
    req = urllib.request.Request(server.url + "/v1/completions", body,
                                 {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as resp:
        out: dict[str, Any] = orjson.loads(resp.read())
    usage = out["usage"]
    return [ord(c) for c in out["choices"][0]["text"]], usage["prompt_tokens_details"][
        "cached_tokens"]


def shared_blocks(server: ServerProc) -> int:
    tiers = server.info()["stats"].get("kv_offload", {}).get("tiers", {})
    return int(tiers.get("shared", {}).get("num_blocks", 0))


def test_replica_b_serves_what_replica_a_computed(tier_model: Path, tmp_path: Path) -> None:
    shared = tmp_path / "shared"
    args = ["--kv-cache-tokens", "2048", "--max-model-len", "512", "--kv-shared-dir", str(shared)]
    ids = prompt(1)
    with contextlib.ExitStack() as stack:
        a, b = start_all(stack, [(tier_model, tmp_path / "a.log", [*args, "--enable-kv-events"]),
                                 (tier_model, tmp_path / "b.log", args)])
        text_a, cached_a = complete(a, ids)
        assert cached_a == 0
        deadline = time.monotonic() + 60
        while shared_blocks(b) < 18:  # B re-scans the shared directory every second
            assert time.monotonic() < deadline, b.info()["stats"]
            time.sleep(0.2)
        text_b, cached_b = complete(b, ids)
        assert text_b == text_a and cached_b >= 288
        deadline = time.monotonic() + 30
        while not b.info()["kv_offload"].get("num_loads"):  # stats arrive every 0.5 s
            assert time.monotonic() < deadline, b.info()
            time.sleep(0.1)
        b.wait_idle()
        info = b.info()
        assert info["kv_offload"]["shared_dir"] == str(shared)
        assert info["kv_offload"]["prefill_tokens_per_s"] is None or \
            info["kv_offload"]["prefill_tokens_per_s"] > 0
        assert info["kv_offload"]["load_bytes_per_s"] > 0
        req = urllib.request.Request(b.url + "/metrics")
        with urllib.request.urlopen(req, timeout=10) as resp:
            text = resp.read().decode()
        assert 'radixserve:kv_offload_hit_tokens_total{tier="shared"} 288.0' in text
        assert 'radixserve:kv_offload_stored_tokens{tier="shared"}' in text
        assert "radixserve:kv_offload_load_bytes_total" in text
        assert "radixserve:kv_offload_load_seconds_total" in text
        # A's /kv_events: pool blocks ("CPU") and the shared tier's ("SHARED").
        req = urllib.request.Request(a.url + "/kv_events?since=0")
        media: set[str | None] = set()
        with urllib.request.urlopen(req, timeout=30) as resp:
            while not {"CPU", "SHARED"} <= media:
                line = resp.readline()
                if line.startswith(b"data: "):
                    for ev in orjson.loads(line[6:])["events"]:
                        media.add(ev.get("medium"))


def test_a_restarted_server_starts_warm(tier_model: Path, tmp_path: Path) -> None:
    args = ["--kv-cache-tokens", "2048", "--max-model-len", "512", "--kv-offload-dir",
            str(tmp_path / "local")]
    sessions = [prompt(10 + i) for i in range(3)]
    with running_server(tier_model, tmp_path / "first.log", args) as first:
        before = [complete(first, ids)[0] for ids in sessions]
        first.wait_idle()
    assert first.proc.returncode == 0
    with running_server(tier_model, tmp_path / "second.log", args) as second:
        for ids, text in zip(sessions, before, strict=True):
            again, cached = complete(second, ids)
            assert again == text and cached >= 0.9 * len(ids), cached
        second.wait_idle()
