"""Multi-LoRA on CPU, side by side in one run: 8 adapters mixed in one batch of 32 against
the base model on the same workload, and against serving the 8 as merged models one after
another; and a run-time load under a decode-heavy run (its steps' times).

    python -m bench.lora                      # smollm2-135m, fp32, rank 8, median of 3
    python -m bench.lora --runs 5 --rank 16

Base: an engine without --enable-lora (and base-only requests on the LoRA engine, which runs
gate/up as one GEMM instead of oneDNN's epilogue-fused halves).
Workload: 32 prompts (~60 tokens each) x 32 greedy output tokens, all submitted at once;
output tok/s = 32 * 32 / wall time of the generate call. Each run uses fresh cache salts (no
prefix hits). LoRA: 4 prompts per adapter, adapters on all 7 projections. Merged models:
a merged checkpoint computes exactly what the base model computes (W' = W + s B A has W's
shape), so "8 merged models one after another" is timed as 8 sequential batches of 4 on the
base weights (the loading of 8 checkpoints, which serving them would also need, is not
counted). The runs interleave (base, LoRA, merged, base, ...) so the shared machine's load
hits all alike.

Load under load: 32 requests decode 64 tokens; at step 8 an adapter load call arrives; the
report gives the median step time and the longest step while the load was in flight.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
import uuid
from collections.abc import Sequence
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from radixserve import LLM, LoRARequest, SamplingParams
from radixserve.ipc.messages import GenerateMsg, LoadLoRAMsg

MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
NUM_ADAPTERS, BATCH, NEW = 8, 32, 32


def make_adapter(path: Path, hf_dir: Path, rank: int, seed: int) -> Path:
    """A random PEFT adapter (peft's key names) for the model in `hf_dir`."""
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    with safe_open(str(hf_dir / "model.safetensors"), framework="pt") as sf:
        for key in sf.keys():
            module = key.rsplit(".", 2)[-2]
            if module not in MODULES:
                continue
            out_f, in_f = sf.get_slice(key).get_shape()
            stem = "base_model.model." + key.removesuffix(".weight")
            tensors[stem + ".lora_A.weight"] = torch.randn(rank, in_f, generator=g) * 0.02
            tensors[stem + ".lora_B.weight"] = torch.randn(out_f, rank, generator=g) * 0.02
    path.mkdir(parents=True)
    save_file(tensors, str(path / "adapter_model.safetensors"))
    (path / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": list(MODULES),
        "bias": "none", "use_dora": False}))
    return path


def prompts(n: int) -> list[str]:
    return [f"Question {i}: explain, step by step and with one example, why topic number {i} "
            f"matters to engineers who build large distributed systems." for i in range(n)]


def timed(llm: LLM, texts: list[str], loras: Sequence[LoRARequest | None] | None) -> float:
    sp = SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True)
    salt = uuid.uuid4().hex  # no prefix hits across runs
    t0 = time.perf_counter()
    llm.generate(texts, sp, salt, lora_request=loras)
    return time.perf_counter() - t0


def throughput(llm: LLM, plain: LLM, adapters: list[LoRARequest], runs: int
               ) -> dict[str, float]:
    """Output tok/s: `base` on an engine without --enable-lora (the base model as served
    today), `base_lora_engine` base-only on the LoRA engine, `lora` the 8 adapters mixed,
    `merged` the 8 merged models one after another (on the plain engine)."""
    texts = prompts(BATCH)
    per = BATCH // NUM_ADAPTERS
    mixed = [adapters[i // per] for i in range(BATCH)]
    timed(llm, texts, mixed)  # warm-up: loads the adapters, first-step costs
    timed(plain, texts, None)
    times: dict[str, list[float]] = {"base": [], "base_lora_engine": [], "lora": [],
                                     "merged": []}
    for run in range(runs):
        times["base"].append(timed(plain, texts, None))
        times["base_lora_engine"].append(timed(llm, texts, None))
        times["lora"].append(timed(llm, texts, mixed))
        times["merged"].append(sum(timed(plain, texts[i * per:(i + 1) * per], None)
                                   for i in range(NUM_ADAPTERS)))
        print(f"run {run}: seconds " + ", ".join(f"{k} {v[-1]:.2f}" for k, v in times.items()),
              flush=True)
    return {k: BATCH * NEW / statistics.median(v) for k, v in times.items()}


def load_under_load(llm: LLM, adapter: LoRARequest) -> dict[str, float]:
    engine = llm.engine
    ids = llm.tokenizer.encode(prompts(1)[0])
    sp = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
    for i in range(BATCH):
        engine.add_request(GenerateMsg(f"load-{i}", ids, sp, uuid.uuid4().hex))
    steps: list[tuple[float, bool]] = []  # (seconds, a load was in flight)
    loading = False
    while engine.has_work():
        if len(steps) == 8:
            engine.call(LoadLoRAMsg("bench-load", "late", adapter.lora_path))
            loading = True
        t0 = time.perf_counter()
        engine.step()
        steps.append((time.perf_counter() - t0, loading))
        if loading and any(r.call_id == "bench-load" for r in engine.drain_replies()):
            loading = False
    during = [s for s, flag in steps if flag]
    return {"median_step_s": statistics.median(s for s, _ in steps),
            "max_step_during_load_s": max(during), "steps_during_load": len(during)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--rank", type=int, default=8)
    ap.add_argument("--runs", type=int, default=3)
    args = ap.parse_args()
    llm = LLM(model=args.model, dtype="float32", enable_lora=True, max_loras=NUM_ADAPTERS,
              max_cpu_loras=NUM_ADAPTERS + 1, max_lora_rank=args.rank, kv_cache_tokens=16384)
    plain = LLM(model=args.model, dtype="float32", kv_cache_tokens=16384)
    hf_dir = llm.engine.runner.resolved.hf_dir
    with tempfile.TemporaryDirectory() as tmp:
        adapters = [LoRARequest(f"a{i}", i + 1, str(make_adapter(Path(tmp) / f"a{i}", hf_dir,
                                                                 args.rank, i)))
                    for i in range(NUM_ADAPTERS + 1)]
        tps = throughput(llm, plain, adapters[:NUM_ADAPTERS], args.runs)
        print(f"output tok/s (median of {args.runs}, {BATCH} x {NEW} tokens, rank {args.rank}):"
              f" base {tps['base']:.1f} (on the LoRA engine {tps['base_lora_engine']:.1f}), "
              f"{NUM_ADAPTERS} adapters mixed {tps['lora']:.1f} "
              f"({tps['lora'] / tps['base']:.2f}x base), {NUM_ADAPTERS} merged models one "
              f"after another {tps['merged']:.1f} ({tps['lora'] / tps['merged']:.2f}x of it)",
              flush=True)
        load = load_under_load(llm, adapters[NUM_ADAPTERS])
        print(f"load under load: median step {load['median_step_s'] * 1e3:.1f} ms, longest "
              f"step while loading {load['max_step_during_load_s'] * 1e3:.1f} ms "
              f"({load['steps_during_load']:.0f} steps during the load)")


if __name__ == "__main__":
    main()
