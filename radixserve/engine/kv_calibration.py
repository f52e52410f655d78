"""Where an 8-bit KV cache's scales come from: the checkpoint, or a calibration pass at start-up.

Owns: reading per-layer K/V scales a checkpoint carries (vLLM / llm-compressor's names,
`model.layers.N.self_attn.k_scale` and `v_scale`, a scalar or one per KV head), and
otherwise measuring them: one prefill of a built-in text through the model with a small
full-precision pool, recording every layer's largest |K| and |V| per KV head
(attention/kv_quant.scales_from_amax turns them into scales). Does not know: the pool's
sizing, the kernels; the model runner calls it once, before serving.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any, NamedTuple

import torch
from safetensors import safe_open

from radixserve.attention.base import AttentionBackend, AttentionMetadata
from radixserve.attention.kv_quant import KVScale, scales_from_amax
from radixserve.cache.kv_pool import KVPool
from radixserve.model.families.base import CausalLM
from radixserve.types import Phase

# Mixed registers on purpose (prose, dialogue, code, numbers, a list): the K/V ranges of a
# model's heads depend on what it reads, and the scales must cover what it will serve.
CALIBRATION_TEXT = """\
The harbour town woke slowly. Fishing boats came in with the tide, gulls circling above \
the nets, and the baker on Quay Street opened his shutters at six as he had for thirty years.
User: Can you explain what a hash table is, in two sentences?
Assistant: A hash table stores key-value pairs in an array, using a hash function to turn \
each key into an index. Lookups, inserts and deletes take constant time on average.
def fibonacci(n: int) -> list[int]:
    values = [0, 1]
    while len(values) < n:
        values.append(values[-1] + values[-2])
    return values[:n]
Quarterly revenue rose 12.4% to $3.85 billion; operating margin was 21%, up from 18.7%.
Ingredients: 2 cups flour, 1 tsp salt, 3 eggs, 250 ml milk. Whisk, rest 30 minutes, fry.
{"id": 4817, "status": "shipped", "items": [{"sku": "A-19", "qty": 2}], "total": 59.90}
Die Sitzung wurde um 14 Uhr eröffnet. La réunion a commencé à l'heure. 会议准时开始。
In 1905 Einstein published four papers: on the photoelectric effect, Brownian motion, \
special relativity and the equivalence of mass and energy, E = mc^2.
"""

_SCALE_KEY = re.compile(r"(?:model\.)?layers\.(\d+)\.self_attn\.([kv])_scale$")


class KVScales(NamedTuple):
    """(num_layers, kv_heads) float32 each, and where they came from (for the start-up log)."""

    k: torch.Tensor
    v: torch.Tensor
    source: str


def checkpoint_scales(hf_dir: Path, num_layers: int, num_kv_heads: int) -> KVScales | None:
    """The checkpoint's k_scale / v_scale of every layer, or None when it lacks any of them."""
    found: dict[tuple[str, int], torch.Tensor] = {}
    for path in sorted(hf_dir.glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as sf:
            for key in sf.keys():
                m = _SCALE_KEY.fullmatch(key)
                if m:
                    found[(m.group(2), int(m.group(1)))] = sf.get_tensor(key).float().flatten()
    if len(found) != 2 * num_layers:
        return None
    out = {}
    for kind in "kv":
        rows = []
        for layer in range(num_layers):
            t = found.get((kind, layer))
            if t is None or t.numel() not in (1, num_kv_heads):
                return None
            rows.append(t.expand(num_kv_heads))
        out[kind] = torch.stack(rows)  # (num_layers, kv_heads)
    return KVScales(out["k"], out["v"], f"the checkpoint ({hf_dir.name})")


class _AmaxRecorder:
    """An attention backend that records each layer's max |K| and |V| per KV head, in call
    order (one call per layer), and lets the wrapped backend attend."""

    def __init__(self, inner: AttentionBackend) -> None:
        self.inner = inner
        self.k_amax: list[torch.Tensor] = []
        self.v_amax: list[torch.Tensor] = []

    @property
    def reads_shared_prefixes(self) -> bool:
        return self.inner.reads_shared_prefixes

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, meta: AttentionMetadata, scale: float,
                kv_scale: KVScale | None = None, *, window: int | None = None,
                softcap: float | None = None) -> torch.Tensor:
        self.k_amax.append(k.abs().amax(dim=(0, 2)).float())  # (Hkv,)
        self.v_amax.append(v.abs().amax(dim=(0, 2)).float())
        return self.inner.forward(q, k, v, k_cache, v_cache, meta, scale, window=window,
                                  softcap=softcap)


@contextlib.contextmanager
def _recording(model: CausalLM) -> Iterator[_AmaxRecorder]:
    # NOTE: swaps the model's backend for the one calibration forward (start-up, before any
    # request); restored whatever happens. The fused loop (CUDA) stores K/V inside its RoPE
    # kernel and only asks the backend to attend, so the recorder would see nothing: the
    # calibration forward takes the model's own loop, which hands every layer's K/V to
    # backend.forward (same K/V: the fused and unfused loops agree, test_fused_forward.py).
    recorder = _AmaxRecorder(model.backend)
    fused = model.fused
    model.backend, model.fused = recorder, False
    try:
        yield recorder
    finally:
        model.backend, model.fused = recorder.inner, fused


def _prefill_meta(n: int, device: torch.device) -> AttentionMetadata:
    """One request, n new tokens at slots 0..n-1, nothing cached."""
    table = torch.arange(n, dtype=torch.int32, device=device).view(1, n)

    def ints(values: list[int], dtype: torch.dtype) -> torch.Tensor:
        return torch.tensor(values, dtype=dtype, device=device)

    return AttentionMetadata(
        phase=Phase.PREFILL, slot_table=table, rows=ints([0], torch.int64),
        prefix_lens=ints([0], torch.int32), extend_lens=ints([n], torch.int32),
        seq_lens=ints([n], torch.int32), cu_extend=ints([0, n], torch.int32),
        out_slots=torch.arange(n, dtype=torch.int64, device=device), prefix_lens_cpu=(0,),
        extend_lens_cpu=(n,), max_seq_len=n, max_extend_len=n, rows_cpu=(0,))


def calibrate(model: CausalLM, token_ids: list[int], kv_dtype: torch.dtype,
              num_kv_heads: int, head_dim: int, dtype: torch.dtype, device: torch.device
              ) -> KVScales:
    """Scales from one prefill of `token_ids` (the model's own dtype for the K/V it records)."""
    n = len(token_ids)
    layers = len(model.layers)
    cache = torch.zeros((2, layers, n, num_kv_heads, head_dim), dtype=dtype, device=device)
    ids = torch.tensor(token_ids, dtype=torch.int64, device=device)
    with _recording(model) as rec:
        model.forward(ids, torch.arange(n, device=device), _prefill_meta(n, device), cache[0],
                      cache[1], torch.tensor([n - 1], device=device))
    k = scales_from_amax(torch.stack(rec.k_amax), kv_dtype)  # (layers, Hkv)
    v = scales_from_amax(torch.stack(rec.v_amax), kv_dtype)
    return KVScales(k, v, f"calibration over {n} tokens of built-in text")


def set_pool_scales(pool: KVPool, model: CausalLM, tokenizer: Any, hf_dir: Path,
                    max_len: int) -> str:
    """Write an 8-bit pool's scales: the checkpoint's, else calibrated on CALIBRATION_TEXT (at
    most max_len tokens of it). Returns where they came from."""
    assert pool.k_scale is not None and pool.v_scale is not None, "an 8-bit pool"
    layers, _, kv_heads, head_dim = pool.k.shape
    scales = checkpoint_scales(hf_dir, layers, kv_heads)
    if scales is None:
        ids = tokenizer.encode(CALIBRATION_TEXT)[:max_len]
        scales = calibrate(model, ids, pool.dtype, kv_heads, head_dim, model.embed.dtype,
                           pool.k.device)
    pool.k_scale.copy_(scales.k)
    pool.v_scale.copy_(scales.v)
    return scales.source
