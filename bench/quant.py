"""Int8 weights and bf16 against fp32, side by side in one run: speed, memory, quality.

    python -m bench.quant                       # smollm2-135m, median of 3
    python -m bench.quant --runs 1 --configs fp32,int8

Configs: fp32, bf16, int8 (weight-only, fp32 activations: model/quant.py's native kernel at
every row count), int8-fphead (LM head kept in float), int8-bf16 (bf16 activations).

Every engine is loaded once and the runs interleave (config A, B, C, A, B, C, ...), so that
load on this shared machine hits all of them alike. Speed: decode tok/s of one sequence and
of 32 at once (tokens after the first / time after the last first token), prefill tok/s of
one 2048-token prompt (a fresh cache salt each run). Quality: 32 chat prompts x 32 greedy
tokens in one batch, against fp32: the fraction of tokens identical to fp32's before the first
divergence and overall (position by position), and the mean |log-prob| difference of the
chosen token over the positions before the first divergence (same context on both sides).
"""

from __future__ import annotations

import argparse
import statistics
from dataclasses import dataclass

import torch

from radixserve import LLM, SamplingParams
from radixserve.model.cpu_linear import make_linear

TOPICS = [
    "photosynthesis", "the French revolution", "black holes", "how vaccines work", "the stock market",
    "volcanoes", "machine learning", "the water cycle", "ancient Egypt", "climate change",
    "the human heart", "electric cars", "chess openings", "the moon landing", "coffee brewing",
    "honey bees", "the internet", "plate tectonics", "Shakespeare", "solar panels",
    "the immune system", "Roman roads", "jazz music", "DNA replication", "rainbows",
    "the printing press", "recycling plastics", "sleep", "the Great Wall of China", "tides",
    "prime numbers", "bread baking",
]
# name -> (LLM kwargs, keep the LM head in float)
CONFIGS: dict[str, tuple[dict[str, str], bool]] = {
    "fp32": ({"dtype": "float32"}, False),
    "bf16": ({"dtype": "bfloat16"}, False),
    "int8": ({"dtype": "float32", "quantization": "int8"}, False),
    "int8-fphead": ({"dtype": "float32", "quantization": "int8"}, True),
    "int8-bf16": ({"dtype": "bfloat16", "quantization": "int8"}, False),
}


@dataclass
class Quality:
    prefix_agree: float  # tokens identical before the first divergence / fp32's tokens
    overall_agree: float  # tokens identical position by position / fp32's tokens
    mean_abs_logprob_diff: float  # over positions before the first divergence
    forced_agree: float  # teacher-forced: next token == fp32's, given fp32's own prefix


def load(name: str, model: str) -> LLM:
    kwargs, float_head = CONFIGS[name]
    llm = LLM(model, kv_cache_tokens=6144, max_model_len=4096, **kwargs)  # type: ignore[arg-type]
    m = llm.engine.runner.model
    if float_head:  # the LM head in the activation dtype, the layers int8
        m.lm_head.kernel = make_linear(m.embed, None, None)
    return llm


def decode_rate(llm: LLM, prompts: list[list[int]], salt: str) -> float:
    """Decode tokens/s of len(prompts) sequences run together, 33 tokens each."""
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=33, ignore_eos=True),
                        cache_salt=salt)
    start = max(o.ttft for o in outs)
    return sum(len(o.token_ids) - 1 for o in outs) / (max(o.latency for o in outs) - start)


def prefill_rate(llm: LLM, prompt: list[int], salt: str) -> float:
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=1), cache_salt=salt)[0]
    return len(prompt) / out.ttft


def quality(ref: list[tuple[list[int], list[float]]],
            got: list[tuple[list[int], list[float]]]) -> Quality:
    total = prefix = same = 0
    diffs: list[float] = []
    for (rt, rl), (gt, gl) in zip(ref, got, strict=True):
        total += len(rt)
        same += sum(a == b for a, b in zip(rt, gt, strict=False))
        k = 0
        while k < min(len(rt), len(gt)) and rt[k] == gt[k]:
            diffs.append(abs(rl[k] - gl[k]))
            k += 1
        prefix += k
    return Quality(prefix / total, same / total, statistics.fmean(diffs) if diffs else 0.0, 0.0)


def forced_agree(llm: LLM, prompts: list[list[int]],
                 ref: list[tuple[list[int], list[float]]]) -> float:
    """Per-step top-1 agreement: at every position of fp32's greedy output, given the prompt
    and fp32's tokens before it, does this config pick fp32's next token? Unlike the prefix
    measure it does not count every token after a first near-tie flip as a miss."""
    contexts = [p + rt[:t] for p, (rt, _) in zip(prompts, ref, strict=True) for t in range(len(rt))]
    wanted = [tok for rt, _ in ref for tok in rt]
    outs = llm.generate(contexts, SamplingParams(temperature=0, max_tokens=1),
                        cache_salt="forced")
    return sum(o.token_ids[0] == w for o, w in zip(outs, wanted, strict=True)) / len(wanted)


def greedy(llm: LLM, prompts: list[list[int]]) -> list[tuple[list[int], list[float]]]:
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=32, logprobs=0),
                        cache_salt="quality")
    return [(o.token_ids, [lp.token_logprob for lp in o.logprobs]) for o in outs]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--configs", default=",".join(CONFIGS))
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--prefill-tokens", type=int, default=2048)
    ap.add_argument("--quality-only", action="store_true", help="skip the speed runs")
    args = ap.parse_args()
    names = args.configs.split(",")
    assert names[0] == "fp32", "fp32 first: it is the reference"
    llms = {n: load(n, args.model) for n in names}
    tok = llms["fp32"].tokenizer
    from radixserve.tokenizer import encode_chat

    chats = [encode_chat(tok, [{"role": "user", "content": f"Explain {t} in two sentences."}])
             for t in TOPICS]
    g = torch.Generator().manual_seed(0)
    long_prompt = torch.randint(100, 40000, (args.prefill_tokens,), generator=g).tolist()
    rates: dict[str, dict[str, list[float]]] = {n: {"b1": [], "b32": [], "pre": []} for n in names}
    for run in range(0 if args.quality_only else args.runs):
        for n, llm in llms.items():
            rates[n]["b1"].append(decode_rate(llm, chats[:1], f"b1-{run}"))
            rates[n]["b32"].append(decode_rate(llm, chats, f"b32-{run}"))
            rates[n]["pre"].append(prefill_rate(llm, long_prompt, f"pre-{run}"))
            print(f"run {run} {n}: " + ", ".join(f"{k} {v[-1]:.1f}" for k, v in rates[n].items()),
                  flush=True)
    ref = greedy(llms["fp32"], chats)
    threads = torch.get_num_threads()
    print(f"\n{args.model}, {threads} thread(s), tok/s median of {args.runs} (median ratio to "
          "fp32 within a run)")
    print(f"{'config':<13} {'decode b1':>16} {'decode b32':>16} {'prefill':>16} "
          f"{'linear MB':>10} {'prefix agr':>10} {'overall':>8} {'|dlogp|':>8} "
          f"{'forced':>7}")
    nan = float("nan")
    med = {n: {k: statistics.median(v) if v else nan for k, v in r.items()}
           for n, r in rates.items()}
    # A ratio is taken within each run (neighbouring measurements), then the median of those.
    ratio = {n: {k: statistics.median(a / b for a, b in zip(v, rates["fp32"][k], strict=True))
                 if v else nan for k, v in r.items()} for n, r in rates.items()}
    for n, llm in llms.items():
        q = quality(ref, greedy(llm, chats)) if n != "fp32" else Quality(1.0, 1.0, 0.0, 1.0)
        q.forced_agree = forced_agree(llm, chats, ref)
        layers, head = llm.engine.runner.model.linear_weight_bytes()
        cells = [f"{med[n][k]:7.1f} ({ratio[n][k]:4.2f}x)" for k in ("b1", "b32", "pre")]
        print(f"{n:<13} {cells[0]:>16} {cells[1]:>16} {cells[2]:>16} "
              f"{(layers + head) / 1e6:10.1f} {q.prefix_agree:10.3f} {q.overall_agree:8.3f} "
              f"{q.mean_abs_logprob_diff:8.4f} {q.forced_agree:7.3f}")


if __name__ == "__main__":
    main()
