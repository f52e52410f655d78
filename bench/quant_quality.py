"""Quantized weights' quality on SmolLM2: held-out log-likelihood against bf16.

Measured as bench/kv_quant_quality.py measures the 8-bit KV cache (its text, its scoring).

    python -m bench.quant_quality                  # smollm2-135m, dtype auto

Configs: auto (the model's dtype: bf16 on AVX512-BF16 CPUs), fp8 (`--quantization fp8`:
per-channel e4m3 at load), w4a16-g128 (round-to-nearest int4, group 128, asymmetric, written
as a compressed-tensors pack-quantized checkpoint by tests/quant_checkpoints.py and loaded as
a user's would be), w8a16 (int8 per channel, the same way). Per config: the mean
log-probability of each held-out token given the ones before it, its relative difference to
auto's, the teacher-forced top-1 agreement with auto and the mean KL divergence from auto.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from bench.kv_quant_quality import HELD_OUT, compare, held_out_logp
from radixserve import LLM
from radixserve.model_source import resolve_model
from tests.quant_checkpoints import write_quantized


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--dtype", default="auto")
    args = ap.parse_args()
    src = resolve_model(args.model).hf_dir
    kw = {"dtype": args.dtype, "kv_cache_tokens": 4096, "max_model_len": 2048}
    with tempfile.TemporaryDirectory() as tmp:
        w4, _ = write_quantized(src, Path(tmp) / "w4", "compressed-tensors",
                                format="pack-quantized", bits=4, group=128, symmetric=False)
        w8, _ = write_quantized(src, Path(tmp) / "w8", "compressed-tensors",
                                format="pack-quantized", bits=8)
        models = {"auto": (str(src), {}), "fp8": (str(src), {"quantization": "fp8"}),
                  "w4a16-g128": (str(w4), {}), "w8a16": (str(w8), {})}
        ref = None
        print(f"{args.model}, dtype {args.dtype}")
        for name, (path, extra) in models.items():
            llm = LLM(path, **kw, **extra)  # type: ignore[arg-type]
            ids = llm.tokenizer.encode(HELD_OUT)
            lp, _ = held_out_logp(llm, ids)
            ref = lp if ref is None else ref
            ll, top, kl = compare(ref, lp, ids)
            ll_ref = compare(ref, ref, ids)[0]
            layers, head = llm.engine.runner.model.linear_weight_bytes()
            print(f"  {name:11s} layers {layers / 1e6:6.1f} MB  mean loglik {ll:.4f}  rel. diff "
                  f"{abs(ll - ll_ref) / abs(ll_ref):.2%}  forced top-1 {top:.3f}  KL {kl:.4f}"
                  f"  ({len(ids)} tokens)")
            llm.close()


if __name__ == "__main__":
    main()
