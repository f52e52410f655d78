"""Constrained vs unconstrained decoding, side by side in one run; grammar compile times.

    .venv/bin/python -m bench.grammar                      # SmolLM2, 32 requests, 3 runs
    .venv/bin/python -m bench.grammar --num-requests 64 --runs 5

Throughput: N chat prompts asking for JSON, cycling over the 10 schemas of
bench/common/grammar_schemas.py, greedy. A calibration run decodes them constrained and records each
output length; then, `--runs` times and interleaved, the same prompts run constrained and
unconstrained (ignore_eos, max_tokens = that prompt's constrained length), so both sides
generate exactly the same number of tokens. Prompts are in the radix cache after calibration
for both sides alike, so the comparison is of decode steps. Reported: median output tok/s of
each and their ratio.

Compile: each schema compiled cold (a key never seen) on the compile worker, then again
(cached: a dictionary hit); the tokenizer's one-time grammar view is reported separately.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from bench.common.grammar_schemas import SCHEMAS
from radixserve import LLM
from radixserve.constraints import Constraint, ConstraintKind
from radixserve.engine.engine import _grammar_backend
from radixserve.grammar.compiler import CompileFailed, GrammarCompiler
from radixserve.tokenizer import encode_chat
from radixserve.types import SamplingParams


def schema_constraint(i: int) -> Constraint:
    return Constraint(ConstraintKind.JSON_SCHEMA, json.dumps(SCHEMAS[i % len(SCHEMAS)][0]))


def throughput(llm: LLM, num_requests: int, runs: int, max_tokens: int) -> None:
    prompts = [encode_chat(llm.tokenizer, [{"role": "user", "content":
               f"Request {i}: reply with JSON for the schema "
               f"{json.dumps(SCHEMAS[i % len(SCHEMAS)][0])}"}]) for i in range(num_requests)]
    constrained = [SamplingParams(temperature=0, max_tokens=max_tokens,
                                  constraint=schema_constraint(i)) for i in range(num_requests)]
    calib = llm.generate(prompts, constrained)
    lengths = [len(r.token_ids) for r in calib]
    free = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in lengths]
    rates: dict[str, list[float]] = {"constrained": [], "unconstrained": []}
    for run in range(runs):
        order = [("constrained", constrained), ("unconstrained", free)]
        for name, params in order if run % 2 == 0 else order[::-1]:
            t = time.perf_counter()
            out = llm.generate(prompts, params)
            dt = time.perf_counter() - t
            got = [len(r.token_ids) for r in out]
            assert got == lengths, f"{name}: lengths differ from calibration"
            rates[name].append(sum(got) / dt)
    c, u = statistics.median(rates["constrained"]), statistics.median(rates["unconstrained"])
    print(f"{num_requests} requests, {sum(lengths)} output tokens per run "
          f"(mean {sum(lengths) / len(lengths):.1f} per request), median of {runs}:")
    print(f"  unconstrained {u:8.1f} output tok/s   runs {[round(x, 1) for x in rates['unconstrained']]}")
    print(f"  constrained   {c:8.1f} output tok/s   runs {[round(x, 1) for x in rates['constrained']]}")
    print(f"  constrained / unconstrained = {c / u:.3f}")


def compile_times(llm: LLM) -> None:
    r = llm.engine.runner
    t = time.perf_counter()
    backend = _grammar_backend(r.resolved.hf_dir, r.spec.vocab_size, r.eos_token_ids)
    print(f"tokenizer grammar view (once per engine): {time.perf_counter() - t:.3f} s")
    compiler = GrammarCompiler(lambda: backend)
    cold, cached = [], []
    for schema, _ in SCHEMAS:
        c = Constraint(ConstraintKind.JSON_SCHEMA, json.dumps(schema))
        t = time.perf_counter()
        assert not isinstance(compiler.wait(c), CompileFailed)
        cold.append(time.perf_counter() - t)
        t = time.perf_counter()
        compiler.request(c)
        assert not isinstance(compiler.poll(c), CompileFailed)
        cached.append(time.perf_counter() - t)
    compiler.close()
    print(f"compile per schema ({len(SCHEMAS)} schemas): cold median "
          f"{statistics.median(cold) * 1e3:.2f} ms (max {max(cold) * 1e3:.2f} ms), cached median "
          f"{statistics.median(cached) * 1e6:.1f} us (max {max(cached) * 1e6:.1f} us)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--num-requests", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--runs", type=int, default=3)
    args = ap.parse_args()
    llm = LLM(args.model, dtype=args.dtype)
    print(f"model {args.model}, dtype {llm.engine.info['dtype']}, device {llm.engine.info['device']}")
    compile_times(llm)
    throughput(llm, args.num_requests, args.runs, args.max_tokens)


if __name__ == "__main__":
    main()
