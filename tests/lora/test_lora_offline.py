"""Multi-LoRA offline: three adapters and the base model mixed in one batch give HF
transformers' greedy tokens of the merged models (fp32), cache on and off; adapters are
their own radix namespaces; --max-loras and --max-cpu-loras hold; a loading adapter stalls
nothing but its own requests."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest

import radixserve.lora.manager as manager_module
from radixserve import LLM, LoRARequest, SamplingParams
from radixserve.engine.sampler import SampleResult
from radixserve.ipc.messages import GenerateMsg
from radixserve.sched.req import Batch
from tests.lora.conftest import NUM_NEW, LoRASet
from tests.lora_adapters import make_merged_model, make_peft_adapter
from tests.model.test_parity import hf_greedy, random_prompts
from tests.tiny_models import make_tiny_model

ORDER = [None, "alpha", "beta", "gamma", "alpha", None, "gamma", "beta"]  # one per prompt


def _requests(s: LoRASet, names: list[str | None]) -> list[LoRARequest | None]:
    ids = {n: i + 1 for i, n in enumerate(s.adapters)}
    return [None if n is None else LoRARequest(n, ids[n], str(s.adapters[n])) for n in names]


def _llm(s: LoRASet, **kw: object) -> LLM:
    return LLM(model=str(s.base), dtype="float32", kv_cache_tokens=4096, enable_lora=True,
               max_lora_rank=8, **kw)


@pytest.mark.parametrize(("max_loras", "disable_cache"), [(3, False), (3, True), (1, False)])
def test_mixed_batch_equals_merged_models(lora_set: LoRASet, max_loras: int,
                                          disable_cache: bool) -> None:
    llm = _llm(lora_set, max_loras=max_loras, disable_radix_cache=disable_cache)
    sp = SamplingParams(temperature=0, max_tokens=NUM_NEW, ignore_eos=True)
    for _ in range(2):  # the second round: cache hits (under each prompt's own adapter)
        outs = llm.generate(lora_set.prompts, sp, lora_request=_requests(lora_set, ORDER))
        for i, (out, name) in enumerate(zip(outs, ORDER, strict=True)):
            assert out.error is None, out.error
            assert out.token_ids == lora_set.refs[name][i], (i, name)
    llm.engine.check_integrity()
    assert llm.kv_stats()["kv_held_tokens"] == 0


def test_adapters_never_share_cached_prefixes(lora_set: LoRASet) -> None:
    llm = _llm(lora_set, max_loras=2)
    sp = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    prompt = lora_set.prompts[3]  # 30 tokens
    (alpha, beta) = _requests(lora_set, ["alpha", "beta"])

    def cached(lora: LoRARequest | None, salt: str = "") -> int:
        return llm.generate([prompt], sp, salt, lora_request=lora)[0].num_cached_tokens

    assert cached(alpha) == 0
    assert cached(beta) == 0  # the same prompt under another adapter: not a hit
    assert cached(None) == 0  # nor under the base model
    assert cached(alpha) == len(prompt) - 1  # a repeat under alpha is
    assert cached(alpha, "tenant") == 0  # a salt separates within the adapter
    with pytest.raises(ValueError, match="NUL"):  # a salt cannot forge an adapter namespace
        cached(None, "\x00lora:alpha")
    # The base model's entry under the namespace of alpha's digest is out of reach too.
    ns = llm.engine.scheduler.mem.cache.evictable_by_salt
    assert any("\x00lora:alpha\x00" in k for k in ns) and any("\x00lora:beta\x00" in k for k in ns)


def test_cpu_lru_drops_unused_adapters_and_reloads(lora_set: LoRASet) -> None:
    llm = _llm(lora_set, max_loras=1, max_cpu_loras=1)
    sp = SamplingParams(temperature=0, max_tokens=NUM_NEW, ignore_eos=True)
    for name in ["alpha", "beta", "alpha"]:
        (out,) = llm.generate([lora_set.prompts[0]], sp, lora_request=_requests(lora_set, [name]))
        assert out.token_ids == lora_set.refs[name][0]
    manager = llm.engine.lora
    assert manager is not None and manager.loaded_names == ["alpha"]
    assert manager.num_loads == 3  # alpha was dropped for beta, then read again


def test_lora_keywords_need_enable_lora(lora_set: LoRASet) -> None:
    with pytest.raises(ValueError, match="enable_lora"):
        LLM(model=str(lora_set.base), dtype="float32", kv_cache_tokens=1024, max_loras=2)
    llm = LLM(model=str(lora_set.base), dtype="float32", kv_cache_tokens=1024)
    with pytest.raises(ValueError, match="enable_lora"):
        llm.generate("hi", lora_request=_requests(lora_set, ["alpha"])[0])
    with pytest.raises(ValueError, match="lora_int_id"):
        LoRARequest("x", 0, "/p")


def test_batches_hold_at_most_max_loras_adapters(lora_set: LoRASet) -> None:
    llm = _llm(lora_set, max_loras=2)
    seen: list[set[str]] = []
    run = llm.engine.runner.run

    def spy(batch: Batch) -> SampleResult:
        reqs = batch.rows.reqs if batch.rows is not None else batch.reqs
        seen.append({r.lora_name for r in reqs if r.lora_name is not None})
        return run(batch)

    llm.engine.runner.run = spy  # type: ignore[method-assign]
    sp = SamplingParams(temperature=0, max_tokens=NUM_NEW, ignore_eos=True)
    outs = llm.generate(lora_set.prompts, sp, lora_request=_requests(lora_set, ORDER))
    assert [o.token_ids for o in outs] == [lora_set.refs[n][i] for i, n in enumerate(ORDER)]
    assert max(len(s) for s in seen) == 2  # three adapters wanted, two at a time


def test_a_loading_adapter_never_stalls_other_requests(
        lora_set: LoRASet, monkeypatch: pytest.MonkeyPatch) -> None:
    release = threading.Event()
    real = manager_module.load_peft_adapter

    def slow_load(*args: Any, **kw: Any) -> Any:
        release.wait(30)
        return real(*args, **kw)

    monkeypatch.setattr(manager_module, "load_peft_adapter", slow_load)
    llm = _llm(lora_set)
    engine = llm.engine
    sp = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    (alpha,) = _requests(lora_set, ["alpha"])
    assert alpha is not None
    engine.add_request(GenerateMsg("lora", lora_set.prompts[0], sp, lora_name="alpha",
                                   lora_path=alpha.lora_path))
    engine.add_request(GenerateMsg("base", lora_set.prompts[1], sp))
    done: set[str] = set()
    while "base" not in done:  # the base request runs to the end while alpha loads
        done |= {o.rid for o in engine.step() if o.finish_reason is not None}
    assert "lora" not in done and engine.scheduler.reqs["lora"].lora is None
    release.set()
    tokens = []
    while engine.has_work():
        tokens += [o.token_id for o in engine.step() if o.rid == "lora" and o.token_id is not None]
    assert tokens == lora_set.refs["alpha"][0][:4]


def test_qwen2_family_with_qkv_bias(tmp_path: Path) -> None:
    """Another family through the same hook: Qwen2 (q/k/v biases) with an adapter on q/k/v
    and the MLP, mixed with the base model, equals HF on the merged weights."""
    base = make_tiny_model(tmp_path / "qwen2", "qwen2")
    adapter = make_peft_adapter(tmp_path / "ad", base, ("q_proj", "k_proj", "v_proj",
                                                        "gate_proj", "down_proj"), seed=5)
    merged = make_merged_model(base, adapter, tmp_path / "merged")
    prompts = random_prompts([6, 13], 250, seed=3)
    llm = LLM(model=str(base), dtype="float32", kv_cache_tokens=1024, enable_lora=True)
    sp = SamplingParams(temperature=0, max_tokens=NUM_NEW, ignore_eos=True)
    lora = LoRARequest("q", 1, str(adapter))
    outs = llm.generate(prompts, sp, lora_request=[lora, None])
    assert outs[0].token_ids == hf_greedy(merged, prompts[:1], NUM_NEW)[0]
    assert outs[1].token_ids == hf_greedy(base, prompts[1:], NUM_NEW)[0]
