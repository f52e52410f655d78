"""The server with vLLM's contracts on (fake engine, in-process): --kv-events-config publishes
the same block hashes over ZMQ as the SSE /kv_events, and --metrics-compat vllm adds the
inference extension's gauges with live values; without the flags nothing changes."""

from __future__ import annotations

import asyncio
from pathlib import Path

import orjson
import pytest
from prometheus_client.parser import text_string_to_metric_families

from radixserve.cli import build_config, build_parser
from radixserve.config import KVEventsConfig
from radixserve.kv_events.publisher import decode_batch
from radixserve.server.routes.kv_events import KV_EVENTS_PUBLISHER_KEY
from tests.kv_events.zmq_subscriber import CONFIG, DECODER, Subscriber, local_config
from tests.server.test_app import call, serve
from tests.waiting import wait_until

pytestmark = pytest.mark.timeout(90)

VLLM_GAUGES = ("vllm:num_requests_waiting", "vllm:num_requests_running",
               "vllm:kv_cache_usage_perc")


async def _metrics(tc: object) -> dict[str, float]:
    resp = await tc.get("/metrics")  # type: ignore[attr-defined]
    assert resp.status == 200
    out = {}
    for family in text_string_to_metric_families(await resp.text()):
        for sample in family.samples:
            out[sample.name] = sample.value
    return out


async def test_metrics_compat_vllm_live_values(model_dir: Path) -> None:
    async with serve(model_dir, step_interval=0.02, metrics_compat="vllm",
                     engine={"max_running": 1}) as tc:
        idle = await _metrics(tc)
        assert all(idle[name] == 0 for name in VLLM_GAUGES)
        body = {"prompt": "hello there " * 8, "max_tokens": 60, "ignore_eos": True}
        jobs = [asyncio.create_task(call(tc, "/v1/completions", body)) for _ in range(3)]

        async def busy() -> bool:
            m = await _metrics(tc)
            return (m["vllm:num_requests_running"] == 1 and m["vllm:num_requests_waiting"] == 2
                    and m["vllm:kv_cache_usage_perc"] > 0)

        await wait_until(busy, what="one running, two waiting, KV in use")
        m = await _metrics(tc)
        assert m["vllm:num_requests_waiting"] == m["radixserve:num_requests_waiting"]
        assert 0 < m["vllm:kv_cache_usage_perc"] == m["radixserve:kv_cache_usage_perc"] <= 1
        assert m["vllm:gpu_cache_usage_perc"] == m["vllm:kv_cache_usage_perc"]
        for status, _ in await asyncio.gather(*jobs):
            assert status == 200

        async def idle_again() -> bool:
            m = await _metrics(tc)
            return all(m[name] == 0 for name in VLLM_GAUGES)

        await wait_until(idle_again, what="gauges back to 0")
        text = await (await tc.get("/metrics")).text()
        assert 'vllm:num_requests_running{engine="0",model_name="' in text


def test_metrics_compat_flag_as_the_issue_writes_it() -> None:
    cfg = build_config(build_parser().parse_args(["serve", "--metrics-compat", "vllm"]), {})
    assert cfg.metrics_compat == "vllm"
    with pytest.raises(SystemExit):  # argparse's choices: an unknown engine is refused
        build_parser().parse_args(["serve", "--metrics-compat", "sglang"])


async def test_no_change_without_the_flags(model_dir: Path) -> None:
    async with serve(model_dir) as tc:
        text = await (await tc.get("/metrics")).text()
        names = {f.name for f in text_string_to_metric_families(text)}
        assert not any(n.startswith("vllm:") for n in names)
        assert "radixserve:kv_cache_usage_perc" in names
        status, out = await call(tc, "/kv_events", method="GET")
        assert status == 404 and out["error"]["code"] == "kv_events_disabled"


async def test_kv_events_config_publishes_the_sse_hashes(model_dir: Path) -> None:
    cfg = local_config(CONFIG)
    holder: dict[str, object] = {}

    def find_publisher(app: object) -> None:
        holder["app"] = app

    async with serve(model_dir, kv_events_config=cfg, engine_cfg={"enable_kv_events": True},
                     app_hook=find_publisher) as tc:
        publisher = holder["app"][KV_EVENTS_PUBLISHER_KEY]  # type: ignore[index]
        zpub_publish = publisher.listeners[0]
        zpub = zpub_publish.__self__
        sub = Subscriber(zpub.endpoint, str(zpub.replay_endpoint), "kv-events")
        try:
            for i in range(3):
                status, _ = await call(tc, "/v1/completions",
                                       {"prompt": f"prompt {i} " * 20, "max_tokens": 4})
                assert status == 200
            await wait_until(lambda: zpub.num_sent == publisher.last_seq >= 3,
                             what="every batch sent")
            frames = sub.replay(0)
            for _, payload in frames:
                sub.apply(DECODER.decode(payload))
            resp = await tc.get("/kv_events", params={"since": "0"})
            sse_blocks: set[int] = set()
            buf = b""
            while publisher.last_seq and not buf.count(b"\n\n") >= publisher.last_seq:
                buf += await resp.content.readany()
            resp.close()
            for chunk in buf.split(b"\n\n"):
                if chunk.startswith(b"data: "):
                    for ev in decode_batch(chunk[6:]).events:
                        sse_blocks.update(getattr(ev, "block_hashes", ()))
            assert sub.blocks and sub.blocks == sse_blocks  # one hash chain, two transports
            assert sub.media == {"CPU"}  # the fake engine's device
        finally:
            sub.close()
    assert not publisher.listeners  # closed with the app
    assert isinstance(cfg, KVEventsConfig) and orjson.dumps(cfg.topic) == b'"kv-events"'
