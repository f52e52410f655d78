"""The grammar's tokenizer view: llguidance's own HF reader vs radixserve's llg_tokenizer.

Build time, and bitmask fill time per decode step, side by side in one process, the two
alternating each run; CPU clock (process time) by default. llg_tokenizer (grammar/) keeps
added tokens' `special` flag; llguidance's reader marks every added token special.

    .venv/bin/python -m bench.grammar_tokenizer [--model smollm2-135m] [--runs 5]

Fill: each of bench/common/grammar_schemas' 10 schemas decoded along its example instance,
the mask computed at every step; reported per step per sequence (median over all steps of
all runs). Build: once per engine, on the grammar worker thread.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from typing import Any

import llguidance
import torch
from llguidance.hf import from_tokenizer

from bench.common.grammar_schemas import SCHEMAS
from radixserve.grammar.grammar_text import JSON_OPTIONS
from radixserve.grammar.llg_tokenizer import llg_tokenizer
from radixserve.model_source import resolve_model
from radixserve.tokenizer import load_tokenizer

Clock = Callable[[], float]


def _fills(ll_tok: Any, tok: Any, vocab: int, clock: Clock) -> list[float]:
    out = []
    mask = torch.zeros(1, (vocab + 31) // 32, dtype=torch.int32)
    for schema, instance in SCHEMAS:
        g = llguidance.LLMatcher.grammar_from_json_schema(
            json.dumps({**schema, "x-guidance": JSON_OPTIONS}))
        m = llguidance.LLMatcher(ll_tok, g, log_level=0)
        assert not m.is_error(), m.get_error()
        for t in tok.encode(json.dumps(instance), add_special_tokens=False):
            t0 = clock()
            m.unsafe_compute_mask_ptr(mask.data_ptr(), mask.numel() * 4)
            out.append(clock() - t0)
            assert m.consume_token(t), m.get_error()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--clock", choices=["cpu", "wall"], default="cpu")
    args = ap.parse_args()
    clock: Clock = time.process_time if args.clock == "cpu" else time.perf_counter
    tok = load_tokenizer(resolve_model(args.model).hf_dir)
    vocab, eos = len(tok), [tok.eos_token_id]
    views: dict[str, Callable[[], Any]] = {
        "llguidance.hf": lambda: from_tokenizer(tok, n_vocab=vocab,  # type: ignore[arg-type]
                                                eos_token=eos),
        "llg_tokenizer": lambda: llg_tokenizer(tok, vocab, eos)}
    build: dict[str, list[float]] = {k: [] for k in views}
    fill: dict[str, list[float]] = {k: [] for k in views}
    for run in range(args.runs):
        for name in list(views) if run % 2 == 0 else list(views)[::-1]:
            t0 = clock()
            ll_tok = views[name]()
            build[name].append(clock() - t0)
            fill[name].extend(_fills(ll_tok, tok, vocab, clock))
    print(f"{args.model}: vocab {vocab}, {args.runs} runs, {args.clock} clock")
    for name in views:
        print(f"  {name:14s} build median {statistics.median(build[name]):.3f} s "
              f"(runs {[round(x, 3) for x in build[name]]}); fill per step median "
              f"{statistics.median(fill[name]) * 1e6:.1f} us, mean "
              f"{statistics.mean(fill[name]) * 1e6:.1f} us")
    ratio = statistics.median(build["llg_tokenizer"]) / statistics.median(build["llguidance.hf"])
    print(f"  build llg_tokenizer / llguidance.hf = {ratio:.2f}")


if __name__ == "__main__":
    main()
