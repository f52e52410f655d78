"""Native and operational routes: /generate, /health, /metrics, /server_info, ....

/generate, /health, /metrics, /flush_cache, /server_info, /version.

Owns: SGLang's native /generate shape (`text`, `output_ids`, `meta_info`; streamed chunks carry
the cumulative text, as SGLang's do; `return_logprob` / `top_logprobs_num` add SGLang's
`output_token_logprobs` [[logprob, id, text]] and `output_top_logprobs`, cumulative too) and
the operational endpoints. Does not know: OpenAI's
wire format.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import AsyncGenerator, Callable
from contextlib import aclosing
from importlib.metadata import PackageNotFoundError, version
from typing import Any

from aiohttp import web

from radixserve.api.fields import check_fields, get_bool
from radixserve.api.jobs import ChoiceJob
from radixserve.api.protocol import parse_generate
from radixserve.ipc.client import EngineState
from radixserve.server.app_state import PREVIEW_FIELD, STATE_KEY, read_json
from radixserve.server.choice_stream import ChoiceChunk
from radixserve.server.error_responses import APIError, json_response
from radixserve.server.metrics import CONTENT_TYPE
from radixserve.server.sse import write_sse


def package_version() -> str:
    try:
        return version("radixserve")
    except PackageNotFoundError:
        return "0.0.0+unknown"


async def _generate_events(
    job: ChoiceJob, chunks: AsyncGenerator[ChoiceChunk, None],
    token_str: Callable[[int], str],
) -> AsyncGenerator[dict[str, Any], None]:
    text, output_ids = "", []
    chosen: list[list[Any]] = []  # SGLang's output_token_logprobs: [logprob, id, text]
    tops: list[list[list[Any]] | None] = []  # ... and output_top_logprobs
    async with aclosing(chunks) as stream:
        async for c in stream:
            text += c.text
            output_ids.extend(c.token_ids)
            meta: dict[str, Any] = {
                "id": job.rid, "prompt_tokens": len(job.prompt_ids),
                "completion_tokens": len(output_ids), "cached_tokens": c.num_cached_tokens,
                "finish_reason": None if c.finish_reason is None else {"type": c.finish_reason}}
            if job.params.logprobs is not None:
                for token_id, lp in zip(c.token_ids, c.logprobs, strict=True):
                    chosen.append([None if lp is None else lp.token_logprob, token_id,
                                   token_str(token_id)])
                    tops.append(None if lp is None else
                                [[v, t, token_str(t)] for t, v in lp.top])
                meta["output_token_logprobs"], meta["output_top_logprobs"] = chosen, tops
            yield {"text": text, "output_ids": list(output_ids), "meta_info": meta}


async def generate(request: web.Request) -> web.StreamResponse:
    state = request.app[STATE_KEY]
    state.ensure_ready()
    arrival = time.perf_counter()
    req = parse_generate(await read_json(request), state.check_constraint)
    prompt = await state.encode(req.prompt)
    if isinstance(req.prompt, str):
        request[PREVIEW_FIELD] = req.prompt
    (job,) = state.caller_jobs(request, [prompt], req.opts, "text")
    job = dataclasses.replace(job, num_continued=req.num_continued)
    with state.admit(request, [job]) as ticket:
        chunks = state.outputs([job], arrival, ticket, req.opts.timeout)
        events = _generate_events(job, chunks, state.token_str)
        if req.opts.stream:
            return await write_sse(request, events)
        last: dict[str, Any] = {}
        async with aclosing(events) as stream:
            async for event in stream:
                last = event
        return json_response(last)


async def health(request: web.Request) -> web.Response:
    state = request.app[STATE_KEY]
    client = state.client
    if state.draining:
        return json_response({"status": "draining"}, status=503)
    if state.ready and client.is_alive():
        return json_response({"status": "ok"})
    if client.state is EngineState.LOADING or (client.state is EngineState.READY
                                               and not state.ready):
        return json_response({"status": "loading"}, status=503)
    return json_response({"status": client.state.value, "error": client.error}, status=503)


async def metrics(request: web.Request) -> web.Response:
    body = request.app[STATE_KEY].metrics.render()
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE})


async def flush_cache(request: web.Request) -> web.Response:
    state = request.app[STATE_KEY]
    state.ensure_ready()
    include_pins = False
    if request.can_read_body:
        body = check_fields(await read_json(request), frozenset({"include_pins"}))
        include_pins = bool(get_bool(body, "include_pins"))
    if not await state.client.flush_cache(include_pins):
        raise APIError(409, "the cache was not flushed: requests are running; retry when idle",
                       code="requests_running")
    return json_response({"flushed": True})


async def server_info(request: web.Request) -> web.Response:
    state = request.app[STATE_KEY]
    cfg = state.cfg
    info = state.client.info
    kv_tokens = info.get("kv_cache_tokens")
    server = {k: v for k, v in dataclasses.asdict(cfg).items() if k not in ("engine", "api_keys")}
    server["num_api_keys"] = state.auth.num_keys
    return json_response({
        "version": package_version(),
        "model": state.model_name,
        "status": "ready" if state.ready else state.client.state.value,
        "max_model_len": info.get("max_model_len"),
        "kv_cache_tokens": kv_tokens,
        "kv_cache_dtype": info.get("kv_cache_dtype"),
        "kv_cache_bytes": info.get("kv_cache_bytes"),
        "max_concurrency": info.get("max_concurrency"),
        "moe": info.get("moe"),  # experts, top-k, experts per rank (None: a dense model)
        # the native CPU kernels' tier, e.g. "avx2 (no AVX-512 on this CPU)"; null off CPU
        "cpu_kernels": info.get("cpu_kernels"),
        "engine_info": info,
        "engine_config": dataclasses.asdict(cfg.engine),
        "server_config": server,
        "stats": state.client.stats,
        "kv_offload": _kv_offload(info, state.client.stats),
        "num_queued": state.admission.num_queued,
        "engine_pid": getattr(state.client.transport, "pid", None),
        "uptime_s": round(time.time() - state.started, 3),
    })


def _kv_offload(info: dict[str, Any], stats: dict[str, Any]) -> dict[str, Any] | None:
    """The tiers below the pool: their settings, the measured load bandwidth and prefill rate
    (the load-or-recompute decision), per-tier counters and errors; None without tiers."""
    static = info.get("kv_offload")
    if not static:
        return None
    return {**static, **(stats.get("kv_offload") or {})}


async def version_route(request: web.Request) -> web.Response:
    return json_response({"version": package_version()})


def add_native_routes(app: web.Application) -> None:
    app.router.add_post("/generate", generate)
    app.router.add_get("/health", health)
    app.router.add_get("/metrics", metrics)
    app.router.add_post("/flush_cache", flush_cache)
    app.router.add_get("/server_info", server_info)
    app.router.add_get("/version", version_route)
