"""The baseline users compare against: HF transformers' `generate` behind /v1/completions.

Owns: a minimal OpenAI-compatible server (aiohttp; streaming and not; /v1/models, /health)
over one `generate` call per batch, in two modes:
    single  one request at a time (what a naive `generate` endpoint does);
    batch   collect up to B requests waiting at the same moment, left-pad them, one greedy
            `generate` for all, each row streamed to its client as it is produced.
There is no prefix cache, so usage reports cached_tokens = 0. Rows stop at their own
max_tokens (or EOS unless ignore_eos); the batch runs until its longest row is done.
Does not know: radixserve's engine; it shares only the tokenizer helpers and resolve_model.

Usage: python -m bench.hf_server --model smollm2-135m --port 30001 --mode batch
"""

from __future__ import annotations

import argparse
import asyncio
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

import orjson
import torch
from aiohttp import web
from transformers import (
    AutoModelForCausalLM,
    GenerationConfig,
    StoppingCriteria,
    StoppingCriteriaList,
)
from transformers.generation.streamers import BaseStreamer

from radixserve.tokenizer import encode_prompt, eos_token_ids, load_tokenizer


class Mode(str, Enum):
    SINGLE = "single"
    BATCH = "batch"


@dataclass(frozen=True)
class HFServerConfig:
    model: str = "smollm2-135m"
    host: str = "127.0.0.1"
    port: int = 30001
    mode: Mode = Mode.BATCH
    max_batch_size: int = 32
    batch_window_s: float = 0.005  # how long a batch waits for requests arriving together
    dtype: str = "bfloat16"
    num_threads: int | None = None

    def __post_init__(self) -> None:
        if self.max_batch_size < 1:
            raise ValueError("max_batch_size must be >= 1")
        if self.dtype not in ("bfloat16", "float32", "float16"):
            raise ValueError(f"unsupported dtype {self.dtype!r}")
        if self.batch_window_s < 0:
            raise ValueError("batch_window_s must be >= 0")

    @property
    def batch_size(self) -> int:
        return 1 if self.mode is Mode.SINGLE else self.max_batch_size


@dataclass
class Job:
    """One request; the generate thread feeds `queue` with token ids, then None."""

    prompt_ids: list[int]
    max_tokens: int
    ignore_eos: bool
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue[int | None] = field(default_factory=asyncio.Queue)
    num_emitted: int = 0
    done: bool = False

    def emit(self, token_id: int | None) -> None:
        self.loop.call_soon_threadsafe(self.queue.put_nowait, token_id)


class _RowStreamer(BaseStreamer):
    """Hands each step's tokens, shape (batch,), to the rows that are still running."""

    def __init__(self, jobs: list[Job], eos_ids: frozenset[int]) -> None:
        self.jobs, self.eos_ids, self.seen_prompt = jobs, eos_ids, False

    def put(self, value: torch.Tensor) -> None:
        if not self.seen_prompt:  # generate first puts the (batch, prompt_len) prompt
            self.seen_prompt = True
            return
        for job, tok in zip(self.jobs, value.reshape(-1).tolist(), strict=True):
            if job.done:
                continue
            job.emit(int(tok))
            job.num_emitted += 1
            if job.num_emitted >= job.max_tokens or (not job.ignore_eos and tok in self.eos_ids):
                job.done = True
                job.emit(None)

    def end(self) -> None:
        for job in self.jobs:
            if not job.done:
                job.done = True
                job.emit(None)


class _RowsDone(StoppingCriteria):
    """Per-row stop flags, so generate ends when every row reached its own limit."""

    def __init__(self, jobs: list[Job], prompt_width: int, eos_ids: frozenset[int]) -> None:
        self.limits = torch.tensor([j.max_tokens for j in jobs])  # (batch,)
        self.stop_on_eos = torch.tensor([not j.ignore_eos for j in jobs])  # (batch,)
        self.eos = torch.tensor(sorted(eos_ids), dtype=torch.long)
        self.prompt_width = prompt_width
        self.hit_eos = torch.zeros(len(jobs), dtype=torch.bool)

    def __call__(self, input_ids: torch.Tensor, scores: Any, **kwargs: Any) -> torch.Tensor:
        num_new = input_ids.shape[1] - self.prompt_width
        last = input_ids[:, -1].cpu()  # (batch,)
        self.hit_eos |= torch.isin(last, self.eos) & self.stop_on_eos
        return ((num_new >= self.limits) | self.hit_eos).to(input_ids.device)


class HFGenerator:
    """Owns the model; `run` is called from one worker thread, never on the event loop."""

    def __init__(self, cfg: HFServerConfig) -> None:
        from radixserve.model_source import resolve_model

        resolved = resolve_model(cfg.model)
        self.name = resolved.name
        self.tokenizer = load_tokenizer(resolved.hf_dir)
        self.model = AutoModelForCausalLM.from_pretrained(
            str(resolved.hf_dir), dtype=getattr(torch, cfg.dtype))
        self.model.eval()  # type: ignore[no-untyped-call]
        self.eos_ids = frozenset(eos_token_ids(self.tokenizer, self.model.config.eos_token_id))
        pad = self.tokenizer.pad_token_id
        self.pad_id = int(pad if pad is not None else min(self.eos_ids))

    @torch.inference_mode()
    def run(self, jobs: list[Job]) -> None:
        width = max(len(j.prompt_ids) for j in jobs)
        ids = torch.full((len(jobs), width), self.pad_id, dtype=torch.long)  # (batch, width)
        mask = torch.zeros((len(jobs), width), dtype=torch.long)  # (batch, width)
        for row, job in enumerate(jobs):  # left padding: every row ends at the same column
            ids[row, width - len(job.prompt_ids):] = torch.tensor(job.prompt_ids)
            mask[row, width - len(job.prompt_ids):] = 1
        # NOTE: eos_token_id=None turns off generate's own EOS handling; _RowsDone stops rows.
        gen_cfg = GenerationConfig(  # type: ignore[no-untyped-call]
            max_new_tokens=max(j.max_tokens for j in jobs), do_sample=False,
            pad_token_id=self.pad_id, eos_token_id=None)
        streamer = _RowStreamer(jobs, self.eos_ids)
        try:
            self.model.generate(input_ids=ids, attention_mask=mask, generation_config=gen_cfg,
                                streamer=streamer, stopping_criteria=StoppingCriteriaList(
                                    [_RowsDone(jobs, width, self.eos_ids)]))
        finally:
            streamer.end()  # a failed generate must still release every waiting client


GEN = web.AppKey("generator", HFGenerator)
CFG = web.AppKey("config", HFServerConfig)
PENDING = web.AppKey("pending", asyncio.Queue)


async def _batcher(app: web.Application) -> None:
    cfg, gen, pending = app[CFG], app[GEN], app[PENDING]
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="hf-generate") as pool:
        loop = asyncio.get_running_loop()
        while True:
            batch: list[Job] = [await pending.get()]
            if cfg.batch_size > 1 and cfg.batch_window_s > 0:
                await asyncio.sleep(cfg.batch_window_s)
            while len(batch) < cfg.batch_size and not pending.empty():
                batch.append(pending.get_nowait())
            await loop.run_in_executor(pool, gen.run, batch)


async def _batcher_ctx(app: web.Application) -> Any:
    task = asyncio.create_task(_batcher(app))
    yield
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)


def _error(message: str, status: int = 400, param: str | None = None) -> web.Response:
    return web.json_response({"error": {"message": message, "type": "invalid_request_error",
                                        "param": param, "code": None}}, status=status)


def _parse(body: Any) -> tuple[str, int, bool, bool]:
    """(prompt, max_tokens, stream, ignore_eos) or ValueError with the offending field."""
    if not isinstance(body, dict):
        raise ValueError("body must be a JSON object")
    prompt, max_tokens = body.get("prompt"), body.get("max_tokens", 16)
    if not isinstance(prompt, str):
        raise ValueError("prompt must be a string")
    if not isinstance(max_tokens, int) or max_tokens < 1:
        raise ValueError("max_tokens must be a positive integer")
    return prompt, max_tokens, bool(body.get("stream", False)), bool(body.get("ignore_eos"))


def _chunk(rid: str, model: str, text: str, finish: str | None) -> bytes:
    choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
    return b"data: " + orjson.dumps({"id": rid, "object": "text_completion",
                                      "created": int(time.time()), "model": model,
                                      "choices": [choice]}) + b"\n\n"


async def completions(request: web.Request) -> web.StreamResponse:
    gen = request.app[GEN]
    try:
        prompt, max_tokens, stream, ignore_eos = _parse(await request.json())
    except ValueError as e:
        return _error(str(e))
    job = Job(encode_prompt(gen.tokenizer, prompt), max_tokens, ignore_eos,
              asyncio.get_running_loop())
    await request.app[PENDING].put(job)
    rid, ids, sent = f"cmpl-{uuid.uuid4().hex}", [], ""
    resp: web.StreamResponse | None = None
    if stream:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
    while (tok := await job.queue.get()) is not None:
        ids.append(tok)
        text = str(gen.tokenizer.decode(ids, skip_special_tokens=True))
        delta = "" if text.endswith("\ufffd") else text[len(sent):]  # hold back split UTF-8
        sent += delta
        if resp is not None:
            await resp.write(_chunk(rid, gen.name, delta, None))
    finish = "length" if len(ids) >= max_tokens else "stop"
    usage = {"prompt_tokens": len(job.prompt_ids), "completion_tokens": len(ids),
             "total_tokens": len(job.prompt_ids) + len(ids),
             "prompt_tokens_details": {"cached_tokens": 0}}
    if resp is None:
        return web.json_response({"id": rid, "object": "text_completion", "model": gen.name,
                                  "choices": [{"index": 0, "text": sent, "finish_reason": finish,
                                               "logprobs": None}], "usage": usage})
    await resp.write(_chunk(rid, gen.name, "", finish))
    await resp.write(b"data: " + orjson.dumps({"id": rid, "choices": [], "usage": usage})
                     + b"\n\ndata: [DONE]\n\n")
    return resp


async def models(request: web.Request) -> web.Response:
    return web.json_response({"object": "list", "data": [
        {"id": request.app[GEN].name, "object": "model", "owned_by": "hf-baseline"}]})


async def health(request: web.Request) -> web.Response:
    return web.Response(text="ok")


def create_app(cfg: HFServerConfig, generator: HFGenerator) -> web.Application:
    app = web.Application()
    app[CFG], app[GEN], app[PENDING] = cfg, generator, asyncio.Queue()
    app.cleanup_ctx.append(_batcher_ctx)
    app.router.add_post("/v1/completions", completions)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/health", health)
    return app


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench.hf_server", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=30001)
    p.add_argument("--mode", type=Mode, default=Mode.BATCH, choices=list(Mode))
    p.add_argument("--max-batch-size", type=int, default=32)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--num-threads", type=int, default=None)
    a = p.parse_args(argv)
    cfg = HFServerConfig(model=a.model, host=a.host, port=a.port, mode=a.mode,
                         max_batch_size=a.max_batch_size, dtype=a.dtype, num_threads=a.num_threads)
    if cfg.num_threads:
        torch.set_num_threads(cfg.num_threads)
    web.run_app(create_app(cfg, HFGenerator(cfg)), host=cfg.host, port=cfg.port,
                print=lambda msg: print(msg, flush=True))


if __name__ == "__main__":
    main()
