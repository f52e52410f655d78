"""llguidance vs xgrammar on this machine: compile and bitmask-fill times.

With the model's tokenizer: cold compile time per
JSON schema and bitmask fill time per decode step per sequence (median over the steps of
decoding each schema's example instance). xgrammar is optional (not a dependency).

    .venv/bin/python -m bench.grammar_libs [--model smollm2-135m]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

import llguidance
import torch
from llguidance.hf import from_tokenizer

from bench.common.grammar_schemas import SCHEMAS
from radixserve.grammar.grammar_text import JSON_OPTIONS
from radixserve.model_source import resolve_model
from radixserve.tokenizer import load_tokenizer


def _measure_llguidance(tok: Any, vocab: int, eos: int) -> tuple[list[float], list[float]]:
    t0 = time.perf_counter()
    ll_tok = from_tokenizer(tok, n_vocab=vocab, eos_token=eos)
    print(f"llguidance tokenizer init: {time.perf_counter() - t0:.3f} s")
    compile_s, fill_s = [], []
    mask = torch.zeros(1, (vocab + 31) // 32, dtype=torch.int32)
    for schema, instance in SCHEMAS:
        t0 = time.perf_counter()
        g = llguidance.LLMatcher.grammar_from_json_schema(
            json.dumps({**schema, "x-guidance": JSON_OPTIONS}))
        m = llguidance.LLMatcher(ll_tok, g, log_level=0)
        compile_s.append(time.perf_counter() - t0)
        assert not m.is_error(), m.get_error()
        for t in tok.encode(json.dumps(instance), add_special_tokens=False):
            t0 = time.perf_counter()
            m.unsafe_compute_mask_ptr(mask.data_ptr(), mask.numel() * 4)
            fill_s.append(time.perf_counter() - t0)
            assert m.consume_token(t), m.get_error()
    return compile_s, fill_s


def _measure_xgrammar(tok: Any, vocab: int, eos: int) -> tuple[list[float], list[float]]:
    import xgrammar as xgr

    t0 = time.perf_counter()
    info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=vocab, stop_token_ids=[eos])
    print(f"xgrammar tokenizer init: {time.perf_counter() - t0:.3f} s")
    compile_s, fill_s = [], []
    mask = xgr.allocate_token_bitmask(1, vocab)
    for schema, instance in SCHEMAS:
        compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        t0 = time.perf_counter()
        cg = compiler.compile_json_schema(json.dumps(schema), any_whitespace=False)
        m = xgr.GrammarMatcher(cg)
        compile_s.append(time.perf_counter() - t0)
        for t in tok.encode(json.dumps(instance), add_special_tokens=False):
            t0 = time.perf_counter()
            m.fill_next_token_bitmask(mask, 0)
            fill_s.append(time.perf_counter() - t0)
            assert m.accept_token(t)
    return compile_s, fill_s


def _report(name: str, compile_s: list[float], fill_s: list[float]) -> None:
    print(f"{name:10s} compile per schema (cold): median {statistics.median(compile_s) * 1e3:7.2f} ms"
          f"  mean {statistics.mean(compile_s) * 1e3:7.2f} ms"
          f"  max {max(compile_s) * 1e3:7.2f} ms | mask fill per step per sequence: median "
          f"{statistics.median(fill_s) * 1e6:6.1f} us  mean {statistics.mean(fill_s) * 1e6:6.1f} us  p90 "
          f"{sorted(fill_s)[int(0.9 * len(fill_s))] * 1e6:6.1f} us  ({len(fill_s)} steps)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", default="smollm2-135m")
    args = ap.parse_args()
    resolved = resolve_model(args.model)
    tok = load_tokenizer(resolved.hf_dir)
    vocab = json.loads((resolved.hf_dir / "config.json").read_text())["vocab_size"]
    eos = int(tok.eos_token_id)
    torch.set_num_threads(1)
    _report("llguidance", *_measure_llguidance(tok, vocab, eos))
    try:
        _report("xgrammar", *_measure_xgrammar(tok, vocab, eos))
    except ImportError:
        print("xgrammar not installed (pip install xgrammar) — skipped")


if __name__ == "__main__":
    main()
