"""Quantized checkpoints' decode speed end to end on CPU: W4A16 and FP8 against bf16, LLM.generate.

A random Llama in the Llama-3.2-1B layer shape (hidden 2048, 32 / 8 heads, MLP 8192;
`--layers` of them, the test tokenizer's small vocabulary, so the decoder layers dominate),
saved in bf16 and written as a compressed-tensors W4A16 checkpoint (int4, group 128,
asymmetric) by tests/quant_checkpoints.py, as a user's would be loaded; fp8 is
`--quantization fp8` (per channel) on the bf16 folder. Per config: greedy generation at batch
1 of 1 and of 1 + --output-len tokens (ignore_eos) from one 16-token prompt; decode tok/s =
output-len / (the difference of the two times), the median over --runs. Configs run in turn,
one engine at a time, all with the same threads.

    python -m bench.quant_decode --layers 4 --num-threads 2
    RADIXSERVE_CPU_ISA=avx2 python -m bench.quant_decode --configs bf16,w4a16
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from radixserve import LLM
from radixserve.platform.cpu_isa import choose_tier
from radixserve.types import SamplingParams
from tests.quant_checkpoints import write_quantized
from tests.tiny_models import make_tokenizer


def make_model(path: Path, layers: int) -> Path:
    tok = make_tokenizer()
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=2048, intermediate_size=8192,
                      num_hidden_layers=layers, num_attention_heads=32, num_key_value_heads=8,
                      max_position_embeddings=1024, eos_token_id=tok.eos_token_id,
                      bos_token_id=None, pad_token_id=tok.pad_token_id, rms_norm_eps=1e-6)
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg)
    with torch.no_grad():
        for p in model.parameters():
            p.data = p.data.normal_(0.0, 0.02).bfloat16()
    model.config.dtype = torch.bfloat16
    model.save_pretrained(path, safe_serialization=True)
    tok.save_pretrained(path)
    return path


def decode_tok_s(llm: LLM, output_len: int, runs: int) -> float:
    prompt = [list(range(3, 19))]  # 16 token ids
    one = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    many = SamplingParams(max_tokens=1 + output_len, temperature=0.0, ignore_eos=True)
    llm.generate(prompt, many)  # warm-up (builds, first-touch of the weights)
    rates = []
    for _ in range(runs):
        t0 = time.perf_counter()
        llm.generate(prompt, one)
        t1 = time.perf_counter()
        llm.generate(prompt, many)
        t2 = time.perf_counter()
        rates.append(output_len / max((t2 - t1) - (t1 - t0), 1e-9))
    return statistics.median(rates)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--num-threads", type=int, default=None)
    ap.add_argument("--configs", default="bf16,w4a16,fp8")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        src = make_model(Path(tmp) / "bf16", args.layers)
        w4, _ = write_quantized(src, Path(tmp) / "w4", "compressed-tensors",
                                format="pack-quantized", bits=4, group=128, symmetric=False)
        models: dict[str, tuple[Path, dict[str, Any]]] = {
            "bf16": (src, {}), "w4a16": (w4, {}), "fp8": (src, {"quantization": "fp8"})}
        kw: dict[str, Any] = {"dtype": "bfloat16", "kv_cache_tokens": 2048,
                              "max_model_len": 1024}
        if args.num_threads is not None:
            kw["num_threads"] = args.num_threads
        print(f"Llama-3.2-1B layer shape x {args.layers}, batch 1, {args.output_len} tokens, "
              f"CPU tier {choose_tier().tier.value}, median of {args.runs}")
        base, names = None, args.configs.split(",")
        for name in names:
            path, extra = models[name]
            llm = LLM(str(path), **kw, **extra)
            rate = decode_tok_s(llm, args.output_len, args.runs)
            layers, _ = llm.engine.runner.model.linear_weight_bytes()
            llm.close()
            base = rate if base is None else base
            print(f"  {name:6s} decode {rate:7.2f} tok/s  {rate / base:5.2f}x {names[0]}"
                  f"  linear weights {layers / 1e6:7.1f} MB")


if __name__ == "__main__":
    main()
