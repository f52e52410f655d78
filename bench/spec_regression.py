"""Speculation's cost where it cannot pay: the random workload, speculation off vs on.

Independent prompts, nothing repeats; offline, output tokens per second, median of rounds.

Owns: this measurement only (the speedup benchmarks are bench/spec.py). Each round draws
fresh prompts (a new seed), so no round drafts from an earlier round's outputs; the off and
on engines alternate within a round, so machine noise hits both alike.

    python -m bench.spec_regression --rounds 3 --speculative-config '{"method": "auto"}'
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from bench.common.workloads import RandomSpec, build_workload
from radixserve import LLM
from radixserve.types import SamplingParams


def run_round(llm: LLM, prompts: list[str], output_len: int) -> float:
    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    start = time.perf_counter()
    outs = llm.generate(prompts, params)
    seconds = time.perf_counter() - start
    return sum(len(o.token_ids) for o in outs) / seconds


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--input-len", type=int, default=256)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--speculative-config", default='{"method": "auto", '
                   '"num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}')
    args = p.parse_args()
    engines = {"off": LLM(args.model, dtype=args.dtype),
               "on": LLM(args.model, dtype=args.dtype,
                         speculative_config=json.loads(args.speculative_config))}
    spec = RandomSpec(args.num_prompts, args.input_len, args.output_len)
    rates: dict[str, list[float]] = {"off": [], "on": []}
    for r in range(args.rounds + 1):  # round 0 warms both engines up, not counted
        prompts = [q.prompt for q in build_workload(spec, engines["off"].tokenizer,
                                                    seed=100 + r).requests]
        for name, llm in engines.items():
            rate = run_round(llm, prompts, args.output_len)
            if r:
                rates[name].append(rate)
    off, on = statistics.median(rates["off"]), statistics.median(rates["on"])
    stats = {k: v for k, v in engines["on"].engine.stats().items() if k.startswith("spec_")}
    print(json.dumps({"off_tok_s": round(off, 1), "on_tok_s": round(on, 1),
                      "on_vs_off": round(on / off, 3), "rounds": rates, "spec": stats}))


if __name__ == "__main__":
    main()
