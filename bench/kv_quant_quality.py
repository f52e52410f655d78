"""An 8-bit KV cache against the model's dtype on the real model: greedy agreement and held-out
log-likelihood, fp8_e4m3 and fp8_e5m2 side by side with auto.

    python -m bench.kv_quant_quality                  # smollm2-135m, dtype auto
    python -m bench.kv_quant_quality --prompts 16 --max-tokens 32
    python -m bench.kv_quant_quality --reference-dtype none     # skip the float32 row
    python -m bench.kv_quant_quality --prompts 1 --max-tokens 1 --current-token

Greedy: --prompts chat prompts x --max-tokens greedy tokens in one batch per engine (the
prompts' K/V and every decoded token's read back from the pool, so quantized); per prompt, the
tokens identical to auto's before the first divergence over auto's tokens, averaged (and the
prompts that agree all the way). Log-likelihood: the mean log-probability of each token of a
held-out text (not the calibration text) given the ones before it, computed in chunks of
CHUNK tokens over a pool of the engine's format and scales, so that every token attends to
stored (quantized) K/V as a decode step does; the relative difference to auto's; and in the
same pass the teacher-forced top-1 agreement: at every position of the held-out text, is the
most likely next token auto's (unlike the greedy prefix, one near-tie flip costs one token),
and the mean KL divergence of the next-token distributions from auto's.

What limits the agreement (--reference-dtype float32, the default): the same measures for the
model in float32 with a float32 KV cache against auto (bf16 on AVX512-BF16 CPUs), i.e. what
bf16's own rounding costs on them; and per format, the quantization error of the K/V that auto
stores for the held-out text under the engine's scales (relative RMS over all layers, and the
fraction of values saturated at the format's largest), with per-channel scales for
comparison (float formats: precision is relative, so a scale per channel changes little).
--current-token also scores the held-out text one token per forward with the e4m3 pool as
served (each token's own K/V read back quantized, as in a decode step) and with a bf16 pool
whose earlier tokens are rounded to e4m3 once attended (the current token exact): does reading
the current token back quantized matter?
"""

from __future__ import annotations

import argparse
import statistics

import torch

from bench.quant import TOPICS
from radixserve import LLM, SamplingParams
from radixserve.attention.base import AttentionMetadata
from radixserve.attention.kv_quant import dequantize, quantize, scales_from_amax
from radixserve.cache.kv_pool import KVPool, KVPoolSize
from radixserve.types import Phase

FORMATS = ("auto", "fp8_e4m3", "fp8_e5m2")
CHUNK = 8  # new tokens per forward: the native decode kernel's path, one row per token
TEMPLATES = ("Explain {} in two sentences.", "Write a short, vivid paragraph about {}.")
HELD_OUT = """\
The lighthouse keeper kept a log of every ship that passed the point. In winter the entries \
grew short: a name, a time, the state of the sea. Most nights nothing passed at all, and he \
wrote only the wind's direction and the number of hours the lamp had burned.
To install the package, create a virtual environment, activate it, and run the installer \
with the requirements file. If the build fails on a missing compiler, install the system's \
development tools first, then retry; the error message names the library it could not find.
Photosynthesis converts light energy into chemical energy. In the chloroplasts, water is \
split, oxygen is released, and the energy captured is stored in sugars that the plant uses \
to grow. Animals, in turn, depend on those sugars, directly or through the food chain.
class Inventory:
    def __init__(self) -> None:
        self.items: dict[str, int] = {}

    def add(self, name: str, count: int = 1) -> None:
        self.items[name] = self.items.get(name, 0) + count
The committee met on Tuesday to review the budget. Spending on maintenance rose by eight \
percent, mostly for the roof of the old library, while the cost of energy fell after the \
new boilers were installed. The chair proposed to set aside a reserve for next year.
User: What is the difference between a list and a tuple in Python?
Assistant: A list is mutable: you can append, remove or change its items after creating it. A tuple is immutable, so it can be used as a dictionary key and signals that the collection is not meant to change. Both keep their items in order and can hold values of any type.
The river rises in the hills above the town and runs south through farmland for sixty kilometres before it reaches the sea. In spring the snowmelt swells it, and twice in the last century it flooded the lower streets; the stone embankment built after the second flood has held ever since, though the water still comes within a hand's width of its top in wet years.
Step 1: Preheat the oven to 180 degrees. Step 2: Mix the flour, sugar and baking powder in a large bowl. Step 3: Beat the eggs with the milk and melted butter, then fold them into the dry ingredients without overmixing. Step 4: Pour the batter into a lined tin and bake for forty minutes, until a skewer comes out clean. Let it cool for ten minutes before turning it out.
SELECT customer_id, COUNT(*) AS orders, SUM(total) AS spent
FROM orders
WHERE created_at >= '2024-01-01'
GROUP BY customer_id
HAVING COUNT(*) > 3
ORDER BY spent DESC;
Early telescopes were small refractors that showed the moons of Jupiter and the phases of Venus, evidence that not everything circles the Earth. Larger mirrors followed, and with them nebulae, double stars and, much later, the realization that many faint smudges were galaxies of their own, each holding billions of stars at distances that are hard to imagine.
"""


def greedy(llm: LLM, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    return [list(o.token_ids) for o in llm.generate(prompts, params)]


def agreement(ref: list[list[int]], got: list[list[int]]) -> tuple[float, float]:
    """(mean over prompts of the tokens before the first divergence / ref's tokens, the
    fraction of prompts identical all the way)."""
    fractions = []
    for r, g in zip(ref, got, strict=True):
        k = 0
        while k < min(len(r), len(g)) and r[k] == g[k]:
            k += 1
        fractions.append(k / len(r))
    return statistics.fmean(fractions), sum(f == 1.0 for f in fractions) / len(fractions)


def _meta(start: int, n: int, table: torch.Tensor) -> AttentionMetadata:
    dev = table.device

    def ints(values: list[int], dtype: torch.dtype = torch.int32) -> torch.Tensor:
        return torch.tensor(values, dtype=dtype, device=dev)

    return AttentionMetadata(
        phase=Phase.PREFILL, slot_table=table, rows=ints([0], torch.int64),
        prefix_lens=ints([start]), extend_lens=ints([n]), seq_lens=ints([start + n]),
        cu_extend=ints([0, n]), out_slots=torch.arange(start, start + n, device=dev),
        prefix_lens_cpu=(start,), extend_lens_cpu=(n,), max_seq_len=start + n,
        max_extend_len=n, rows_cpu=(0,))


@torch.inference_mode()
def held_out_logp(llm: LLM, ids: list[int], chunk: int = CHUNK,
                  round_after: KVPool | None = None) -> tuple[torch.Tensor, KVPool]:
    """log p(. | ids[:i + 1]) for every position i < len(ids) - 1, (n - 1, vocab) float32, in
    `chunk`-token forwards over a fresh pool of the engine's storage dtype and scales (the
    engine's own pool is left alone); and that pool, holding the text's K/V. round_after (an
    8-bit pool, llm's in the model's dtype): each forward's K/V are rounded to its format and
    scales right after the forward that attended to them as computed."""
    r = llm.engine.runner
    n = len(ids)
    layers, _, hkv, d = r.pool.k.shape
    pool = KVPool(KVPoolSize(n, 1), layers, hkv, d, 1, n, r.pool.dtype, r.device)
    if pool.k_scale is not None and pool.v_scale is not None:
        assert r.pool.k_scale is not None and r.pool.v_scale is not None
        pool.k_scale.copy_(r.pool.k_scale)
        pool.v_scale.copy_(r.pool.v_scale)
    pool.slot_table[0] = torch.arange(n, dtype=torch.int32)
    tokens = torch.tensor(ids, device=r.device)
    out = []
    for start in range(0, n - 1, chunk):
        m = min(chunk, n - 1 - start)
        logits = r.model.forward(tokens[start : start + m], torch.arange(start, start + m),
                                 _meta(start, m, pool.slot_table), pool.k, pool.v,
                                 torch.arange(m), pool.layer_scales())  # (m, vocab)
        out.append(torch.log_softmax(logits.float(), dim=-1))
        if round_after is not None and round_after.k_scale is not None:
            assert round_after.v_scale is not None
            for cache, scales in ((pool.k, round_after.k_scale), (pool.v, round_after.v_scale)):
                for layer in range(layers):
                    rows = cache[layer, start : start + m]  # (m, Hkv, D)
                    rows.copy_(dequantize(quantize(rows, scales[layer], round_after.dtype),
                                          scales[layer], rows.dtype))
    return torch.cat(out), pool


def current_token_probe(llms: dict[str, LLM], ids: list[int]) -> None:
    auto, e4m3 = llms["auto"], llms["fp8_e4m3"]
    ref = held_out_logp(auto, ids, 1)[0]
    served = held_out_logp(e4m3, ids, 1)[0]
    exact = held_out_logp(auto, ids, 1, round_after=e4m3.engine.runner.pool)[0]
    print("one token per forward, against auto (bf16):")
    for name, lp in (("e4m3, current token read back quantized", served),
                     ("e4m3 earlier tokens, current token exact", exact)):
        ll, top, kl = compare(ref, lp, ids)
        print(f"  {name:<42} forced top-1 {top:.3f}  KL {kl:.5f}  mean loglik {ll:.4f}")


def compare(ref: torch.Tensor, got: torch.Tensor, ids: list[int]) -> tuple[float, float, float]:
    """(mean log-likelihood of `got`, teacher-forced top-1 agreement with ref, mean KL(ref ||
    got)) over the held-out positions; ref, got (n - 1, vocab) log-probabilities."""
    target = torch.tensor(ids[1:])[:, None]
    ll = got.gather(1, target).mean().item()
    top = (ref.argmax(-1) == got.argmax(-1)).float().mean().item()
    kl = (ref.exp() * (ref - got)).sum(-1).mean().item()
    return ll, top, kl


def quant_error(auto_pool: KVPool, pool: KVPool) -> tuple[float, float, float]:
    """The K/V auto stored for the held-out text, quantized with `pool`'s format and scales:
    (relative RMS error, fraction saturated, relative RMS error with per-channel scales)."""
    assert pool.k_scale is not None and pool.v_scale is not None
    fmt, fmax = pool.dtype, torch.finfo(pool.dtype).max
    err = ref = sat = err_ch = 0.0
    count = 0
    for x, scales in ((auto_pool.k, pool.k_scale), (auto_pool.v, pool.v_scale)):
        for layer in range(x.shape[0]):
            full = x[layer].float()  # (n, Hkv, D)
            back = dequantize(quantize(full, scales[layer], fmt), scales[layer], torch.float32)
            ch = scales_from_amax(full.abs().amax(dim=0), fmt)  # (Hkv, D): per channel
            back_ch = (full / ch).clamp(-fmax, fmax).to(fmt).float() * ch
            err += (back - full).pow(2).sum().item()
            err_ch += (back_ch - full).pow(2).sum().item()
            ref += full.pow(2).sum().item()
            sat += ((full / scales[layer][:, None]).abs() >= fmax).sum().item()
            count += full.numel()
    return (err / ref) ** 0.5, sat / count, (err_ch / ref) ** 0.5


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--current-token", action="store_true",
                    help="also the current-token probe (two more passes, one token each)")
    ap.add_argument("--reference-dtype", default="float32",
                    help="also compare the model in this dtype (KV auto) with auto; 'none': skip")
    args = ap.parse_args()

    def load(kv: str, dtype: str) -> LLM:
        return LLM(args.model, dtype=dtype, kv_cache_dtype=kv, kv_cache_tokens=16384,
                   max_model_len=2048)

    llms = {f: load(f, args.dtype) for f in FORMATS}
    if args.reference_dtype != "none":
        llms[f"auto, {args.reference_dtype} model"] = load("auto", args.reference_dtype)
    tok = llms["auto"].tokenizer
    from radixserve.tokenizer import encode_chat

    topics = [t.format(topic) for t in TEMPLATES for topic in TOPICS][: args.prompts]
    prompts = [encode_chat(tok, [{"role": "user", "content": c}]) for c in topics]
    held_out = tok.encode(HELD_OUT)
    ref = greedy(llms["auto"], prompts, args.max_tokens)
    lp_auto, auto_pool = held_out_logp(llms["auto"], held_out)
    ll_auto = compare(lp_auto, lp_auto, held_out)[0]
    print(f"{args.model}, dtype {llms['auto'].engine.runner.dtype}, {len(prompts)} prompts x "
          f"{args.max_tokens} greedy tokens; held-out text {len(held_out)} tokens")
    print(f"{'kv-cache-dtype':<22} {'prefix agree':>12} {'all same':>9} {'mean loglik':>12} "
          f"{'rel. diff':>9} {'forced top-1':>12} {'KL':>8} {'K/V rel. err':>12} "
          f"{'saturated':>9} {'per-channel':>11}")
    print(f"{'auto':<22} {1.0:12.3f} {1.0:9.3f} {ll_auto:12.4f} {0.0:9.4f} {1.0:12.3f} "
          f"{0.0:8.5f}")
    for name, llm in list(llms.items())[1:]:
        prefix, same = agreement(ref, greedy(llm, prompts, args.max_tokens))
        lp, pool = held_out_logp(llm, held_out)
        ll, top, kl = compare(lp_auto, lp, held_out)
        errs = ""
        if pool.k_scale is not None:
            rel, sat, rel_ch = quant_error(auto_pool, pool)
            errs = f" {rel:12.4f} {sat:9.2e} {rel_ch:11.4f}"
        print(f"{name:<22} {prefix:12.3f} {same:9.3f} {ll:12.4f} "
              f"{abs(ll - ll_auto) / abs(ll_auto):9.4f} {top:12.3f} {kl:8.5f}{errs}")
    if args.current_token:
        current_token_probe(llms, held_out)


if __name__ == "__main__":
    main()
