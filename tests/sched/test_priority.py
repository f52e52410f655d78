"""Request priority (lower = more important, as vLLM): admission order, preemption victims."""

from __future__ import annotations

import statistics
from pathlib import Path

from radixserve import LLM, SamplingParams
from radixserve.sched.preemption import pick_victim
from tests.sched.test_scheduler import fake_run, make_scheduler


def test_high_priority_request_behind_64_low_ones_starts_before_their_median(
        tiny_llama: Path) -> None:
    llm = LLM(model=str(tiny_llama), dtype="float32", kv_cache_tokens=8192,
              max_prefill_tokens=128)  # ~4 prompts per prefill step: the queue backs up
    prompts = [[3 + i % 200] + [5 + (i * 7 + j) % 240 for j in range(29)] for i in range(65)]
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    for prioritized in (True, False):
        priority = [1] * 64 + [0 if prioritized else 1]  # the important one is submitted last
        outs = llm.generate(prompts, params, priority=priority)
        low = statistics.median(o.ttft for o in outs[:64])
        if prioritized:
            assert outs[64].ttft < low, (outs[64].ttft, low)
        else:  # the control: without priority it waits behind the others
            assert outs[64].ttft > low, (outs[64].ttft, low)
        llm.engine.flush_cache()
    llm.engine.check_integrity()


def test_preemption_picks_the_least_important_request_first() -> None:
    sched = make_scheduler(pages=400, page_size=1)
    params = SamplingParams(max_tokens=30, ignore_eos=True)
    sched.add("batch-old", [6, 7, 8, 9, 10], params, priority=3)
    sched.add("important", [1, 2, 3, 4, 5], params, priority=0)
    sched.add("batch-new", [11, 12, 13], params, priority=3)
    for _ in range(3):  # admit all three and decode a little
        batch = sched.schedule()
        assert batch is not None
        sched.process_outputs(batch, fake_run(batch))
    assert {r.rid for r in sched.running} == {"batch-old", "important", "batch-new"}
    # Among the unimportant ones: the one that loses least (the shorter prompt computed).
    victim = pick_victim(sched, exclude=[])
    assert victim is not None and victim.rid == "batch-new"
    important = sched.reqs["important"]
    others = [r for r in sched.running if r.priority == 3]
    assert pick_victim(sched, exclude=others) is important  # only when nothing else is left
    sched.check_integrity()
