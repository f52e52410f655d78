"""Random-weight Llama (and Qwen3-MoE) models in real shapes, saved as HF folders, for bench/gpu.py.

Owns: the shapes the GPU figures use (SmolLM2-135M's, a Llama-1B's, a 64-expert Qwen3-MoE), writing one as a
safetensors folder with a word-level tokenizer that covers the whole vocabulary (random
weights emit any id, and every id must decode), and the weight bytes one decode step reads.
Does not know: the engine, timing. Speed does not depend on the weights' values.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

EOS = "<eos>"


@dataclass(frozen=True)
class LlamaShape:
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int
    vocab: int
    tied: bool = True
    experts: int = 0  # a Qwen3-MoE shape: experts per layer (0: a dense Llama)
    top_k: int = 0
    expert_intermediate: int = 0

    def _mlp_params(self, experts: int) -> int:
        if not self.experts:
            return 3 * self.hidden * self.intermediate
        return 3 * self.hidden * self.expert_intermediate * experts + self.hidden * self.experts

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    def num_params(self, active: bool = False) -> int:
        """Parameters once each (a tied LM head is the embedding); `active`: of a MoE's
        experts only the top-k one token uses."""
        kv = self.kv_heads * self.head_dim
        attn = self.hidden * (self.hidden + 2 * kv) + self.hidden * self.hidden
        mlp = self._mlp_params(self.top_k if active else self.experts)
        layer = attn + mlp + 2 * self.hidden  # + two norms
        if self.experts:  # Qwen3-MoE: + the per-head q and k norms
            layer += 2 * self.head_dim
        embed = self.vocab * self.hidden
        return self.layers * layer + embed * (1 if self.tied else 2) + self.hidden

    def step_weight_bytes(self, dtype_bytes: int = 2) -> int:
        """Bytes a decode step must read: every weight but the embedding table (a step
        gathers a few rows of it), and the LM head (the embedding again when tied); of a
        MoE's experts those of one token (the batch-1 floor)."""
        untied_embed = 0 if self.tied else self.vocab * self.hidden
        return (self.num_params(active=True) - untied_embed) * dtype_bytes


# SmolLM2-135M as released; the Llama-1B shape is Llama-3.2-1B's layers with the SmolLM2
# vocabulary (49152, tied), the shape issue 28's "today" figures and 2.1 GB floor were
# measured with. --llama1b-vocab 128256 gives Llama-3.2-1B's own vocabulary.
SHAPES: dict[str, LlamaShape] = {
    "smollm2-135m": LlamaShape(576, 30, 9, 3, 1536, 49152),
    "llama-1b": LlamaShape(2048, 16, 32, 8, 8192, 49152),
    # Issue 39's MoE shape: Qwen3-30B-A3B's layer (hidden 2048, 32 heads, 4 KV heads, experts
    # 768 wide, top-8) with 64 experts and 16 layers: 4.9B parameters, 0.9B active.
    "qwen3-moe": LlamaShape(2048, 16, 32, 4, 6144, 49152, experts=64, top_k=8,
                            expert_intermediate=768),
}


def shape_named(name: str, vocab: int | None = None) -> LlamaShape:
    shape = SHAPES[name]
    return shape if vocab is None else replace(shape, vocab=vocab)


def describe(shape: LlamaShape) -> dict[str, int | bool]:
    return {**asdict(shape), "params": shape.num_params(),
            "active_params": shape.num_params(active=True),
            "step_weight_bytes": shape.step_weight_bytes()}


def save_tokenizer(path: Path, vocab: int) -> None:
    """A word-level tokenizer: id 0 is <eos>, id i is the word 't<i>'."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = {EOS: 0, **{f"t{i}": i for i in range(1, vocab)}}
    tok = Tokenizer(models.WordLevel(vocab=words, unk_token=EOS))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    # transformers leaves the fast tokenizer's __init__ unannotated.
    fast = PreTrainedTokenizerFast(  # type: ignore[no-untyped-call]
        tokenizer_object=tok, eos_token=EOS, pad_token=EOS)
    fast.save_pretrained(path)


def hf_config(shape: LlamaShape, max_positions: int) -> Any:
    """transformers' config of `shape` (LlamaConfig, or Qwen3MoeConfig for a MoE shape)."""
    from transformers import LlamaConfig, Qwen3MoeConfig

    common: dict[str, Any] = {
        "vocab_size": shape.vocab, "hidden_size": shape.hidden,
        "intermediate_size": shape.intermediate, "num_hidden_layers": shape.layers,
        "num_attention_heads": shape.heads, "num_key_value_heads": shape.kv_heads,
        "max_position_embeddings": max_positions, "tie_word_embeddings": shape.tied,
        "rms_norm_eps": 1e-5, "eos_token_id": 0, "bos_token_id": None, "pad_token_id": 0,
    }
    if not shape.experts:
        return LlamaConfig(**common)
    common["head_dim"] = shape.head_dim  # a config attribute Qwen3MoeConfig's stub lacks
    return Qwen3MoeConfig(**common, num_experts=shape.experts, num_experts_per_tok=shape.top_k,
                          moe_intermediate_size=shape.expert_intermediate, norm_topk_prob=True)


def hf_model(config: Any) -> Any:
    """The random-init HF model of hf_config's config (on the current default device)."""
    from transformers import LlamaForCausalLM, Qwen3MoeForCausalLM

    is_moe = type(config).__name__ == "Qwen3MoeConfig"
    return (Qwen3MoeForCausalLM if is_moe else LlamaForCausalLM)(config)


def save_model(shape: LlamaShape, path: Path, max_positions: int, device: str = "cuda") -> Path:
    """Random bf16 weights in `shape`, written to `path` (safetensors) with its tokenizer."""
    import torch

    torch.manual_seed(0)
    with torch.device(device):
        model = hf_model(hf_config(shape, max_positions)).to(torch.bfloat16)
    model.save_pretrained(path, safe_serialization=True)
    save_tokenizer(path, shape.vocab)
    return path
