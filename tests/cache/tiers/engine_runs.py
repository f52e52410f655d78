"""The tier engine tests' shared helpers: a tiny fp32 LLM, random prompts, sequential runs.

`make_llm` opens the tiny model with a small pool (a few prompts evict the earlier ones),
`prompts` makes seeded token prompts, `run` drives the engine one prompt at a time checking
the page invariant after each step, `warm_choice` gives the tier choice its cost model.

Owns: how the tier tests (engine, faults, slow disk, GPU) build and drive an engine. Does not
know: what any test asserts beyond the pool being empty after a run.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from radixserve import LLM
from radixserve.ipc.messages import GenerateMsg
from radixserve.types import SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
POOL = 600  # tokens: a few prompts fill it, so sessions are evicted between their turns


def prompts(n: int, length: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [[i + 3] + torch.randint(3, 250, (length - 1,), generator=g).tolist()
            for i in range(n)]


def make_llm(model: Path, **kw: Any) -> LLM:
    kw.setdefault("kv_cache_tokens", POOL)
    kw.setdefault("max_model_len", 512)
    return LLM(model=str(model), dtype="float32", **kw)


def run(llm: LLM, batch: list[list[int]], salt: str = "", params: SamplingParams = GREEDY,
        check: bool = True) -> tuple[list[list[int]], list[int]]:
    """Run prompts one after another (each evicts the previous ones from a small pool),
    checking the page invariant after every step (`check`: a slow disk makes the stores'
    recount slow); tokens and cached-token counts."""
    engine = llm.engine
    outs, cached = [], []
    for i, p in enumerate(batch):
        rid = f"{salt}-{i}-{len(engine.timings)}"
        engine.add_request(GenerateMsg(rid, p, params, salt))
        toks: list[int] = []
        while engine.has_work():
            for o in engine.step():
                if o.token_id is not None:
                    toks.append(o.token_id)
                if o.finish_reason is not None:
                    cached.append(o.num_cached_tokens)
            if check:
                engine.check_integrity()
        outs.append(toks)
    assert llm.kv_stats()["kv_held_tokens"] == 0
    return outs, cached


def warm_choice(llm: LLM, batch: list[list[int]]) -> None:
    """Compute prompts of varied lengths cold (the engine's prefill timings fit its cost
    model), then demote the pool into the local tier."""
    shapes = prompts(8, 64, seed=9) + [p[:n] for p, n in zip(prompts(4, 512, seed=10),
                                                               (96, 200, 350, 480), strict=True)]
    run(llm, shapes + batch)
    assert llm.engine.flush_cache()
