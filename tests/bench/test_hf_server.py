"""bench.hf_server on a tiny random model: exact lengths, greedy parity with HF, both modes."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import pytest
import torch
from aiohttp import web
from transformers import AutoModelForCausalLM

from bench.common.client import ClientConfig
from bench.common.workloads import SharedPrefixSpec, build_workload
from bench.hf_server import HFGenerator, HFServerConfig, Mode, create_app
from bench.serving import run_benchmark
from radixserve.tokenizer import encode_prompt, load_tokenizer


async def _serve(cfg: HFServerConfig, gen: HFGenerator) -> tuple[web.AppRunner, str]:
    runner = web.AppRunner(create_app(cfg, gen))
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    return runner, f"http://127.0.0.1:{runner.addresses[0][1]}"


@pytest.fixture(scope="module")
def generator(tiny_llama: Path) -> HFGenerator:
    return HFGenerator(HFServerConfig(model=str(tiny_llama), dtype="float32"))


@pytest.fixture(params=[Mode.SINGLE, Mode.BATCH])
async def server(request: pytest.FixtureRequest, generator: HFGenerator
                 ) -> AsyncIterator[str]:
    cfg = HFServerConfig(mode=request.param, max_batch_size=8, dtype="float32")
    runner, url = await _serve(cfg, generator)
    try:
        yield url
    finally:
        await runner.cleanup()


def _hf_greedy(model_dir: Path, prompt: str, n: int) -> str:
    tok = load_tokenizer(model_dir)
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    ids = torch.tensor([encode_prompt(tok, prompt)])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n,
                         min_new_tokens=n, do_sample=False, pad_token_id=tok.pad_token_id)
    return tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True)


async def test_benchmark_through_hf_server(server: str, tiny_llama: Path) -> None:
    tok = load_tokenizer(tiny_llama)
    spec = SharedPrefixSpec(num_groups=2, prompts_per_group=4, system_prompt_len=24,
                            question_len=4, output_len=6)
    w = build_workload(spec, tok, seed=0)
    run = await run_benchmark(ClientConfig(server, disable_tqdm=True), w)
    s = run.summary
    assert (s.completed, s.failed) == (8, 0)
    assert s.total_output_tokens == 8 * 6 and s.short_outputs == 0  # ignore_eos honoured
    assert s.total_prompt_tokens == 8 * 28
    assert s.hit_rate == 0.0  # no prefix cache, reported honestly
    assert s.ttft.n == 8 and s.itl.n > 0


async def test_greedy_matches_hf_generate_and_rows_stop_alone(
        server: str, tiny_llama: Path) -> None:
    prompts = {"hello there": 5, "a much longer prompt than the first": 9}
    async with aiohttp.ClientSession() as session:
        outs = {}
        for prompt, n in prompts.items():
            body = {"prompt": prompt, "max_tokens": n, "ignore_eos": True}
            async with session.post(f"{server}/v1/completions", json=body) as resp:
                data = await resp.json()
                outs[prompt] = data
        for prompt, n in prompts.items():
            assert outs[prompt]["usage"]["completion_tokens"] == n
            assert outs[prompt]["choices"][0]["text"] == _hf_greedy(tiny_llama, prompt, n)
        async with session.post(f"{server}/v1/completions", json={"prompt": 3}) as resp:
            assert resp.status == 400
            assert "prompt" in (await resp.json())["error"]["message"]
        async with session.get(f"{server}/health") as resp:
            assert resp.status == 200


async def test_batch_mode_batches_simultaneous_requests(generator: HFGenerator) -> None:
    calls: list[int] = []
    real_run = generator.run

    def spy(jobs: list) -> None:  # type: ignore[type-arg]
        calls.append(len(jobs))
        real_run(jobs)

    generator.run = spy  # type: ignore[method-assign]
    try:
        cfg = HFServerConfig(mode=Mode.BATCH, max_batch_size=4, batch_window_s=0.05,
                             dtype="float32")
        runner, url = await _serve(cfg, generator)
        try:
            prompts = tuple(f"prompt number {i}" for i in range(6))
            from bench.common.workloads import BenchRequest, Workload, WorkloadKind

            w = Workload(WorkloadKind.RANDOM, SharedPrefixSpec(), 0, requests=tuple(
                BenchRequest(p, 0, 3) for p in prompts), warmup_prompts=())
            run = await run_benchmark(ClientConfig(url, disable_tqdm=True, warmup=0), w)
        finally:
            await runner.cleanup()
    finally:
        generator.run = real_run  # type: ignore[method-assign]
    assert run.summary.completed == 6
    assert max(calls) == 4 and sum(calls) == 6  # at most B rows per generate call
