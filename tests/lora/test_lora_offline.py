"""Multi-LoRA offline: three adapters and the base model mixed in one batch give HF
transformers' greedy tokens of the merged models (fp32), cache on and off; adapters are
their own radix namespaces; --max-loras and --max-cpu-loras hold."""

from __future__ import annotations

import pytest

from radixserve import LLM, LoRARequest, SamplingParams
from tests.lora.conftest import NUM_NEW, LoRASet

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
