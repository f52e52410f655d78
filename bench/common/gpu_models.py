"""Random-weight Llama models in real shapes, saved as HF folders, for bench/gpu.py.

Owns: the shapes the GPU figures use (SmolLM2-135M's, a Llama-1B's), writing one as a
safetensors folder with a word-level tokenizer that covers the whole vocabulary (random
weights emit any id, and every id must decode), and the weight bytes one decode step reads.
Does not know: the engine, timing. Speed does not depend on the weights' values.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from pathlib import Path

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

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    def num_params(self) -> int:
        """Parameters once each (a tied LM head is the embedding)."""
        kv = self.kv_heads * self.head_dim
        attn = self.hidden * (self.hidden + 2 * kv) + self.hidden * self.hidden
        mlp = 3 * self.hidden * self.intermediate
        layer = attn + mlp + 2 * self.hidden  # + two norms
        embed = self.vocab * self.hidden
        return self.layers * layer + embed * (1 if self.tied else 2) + self.hidden

    def step_weight_bytes(self, dtype_bytes: int = 2) -> int:
        """Bytes a decode step must read: every weight but the embedding table (a step
        gathers a few rows of it), and the LM head (the embedding again when tied)."""
        untied_embed = 0 if self.tied else self.vocab * self.hidden
        return (self.num_params() - untied_embed) * dtype_bytes


# SmolLM2-135M as released; the Llama-1B shape is Llama-3.2-1B's layers with the SmolLM2
# vocabulary (49152, tied), the shape issue 28's "today" figures and 2.1 GB floor were
# measured with. --llama1b-vocab 128256 gives Llama-3.2-1B's own vocabulary.
SHAPES: dict[str, LlamaShape] = {
    "smollm2-135m": LlamaShape(576, 30, 9, 3, 1536, 49152),
    "llama-1b": LlamaShape(2048, 16, 32, 8, 8192, 49152),
}


def shape_named(name: str, vocab: int | None = None) -> LlamaShape:
    shape = SHAPES[name]
    return shape if vocab is None else replace(shape, vocab=vocab)


def describe(shape: LlamaShape) -> dict[str, int | bool]:
    return {**asdict(shape), "params": shape.num_params(),
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


def save_model(shape: LlamaShape, path: Path, max_positions: int, device: str = "cuda") -> Path:
    """Random bf16 weights in `shape`, written to `path` (safetensors) with its tokenizer."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=shape.vocab, hidden_size=shape.hidden, intermediate_size=shape.intermediate,
        num_hidden_layers=shape.layers, num_attention_heads=shape.heads,
        num_key_value_heads=shape.kv_heads, max_position_embeddings=max_positions,
        tie_word_embeddings=shape.tied, rms_norm_eps=1e-5, eos_token_id=0, bos_token_id=None,
        pad_token_id=0,
    )
    torch.manual_seed(0)
    with torch.device(device):
        # PreTrainedModel.to is @wraps(nn.Module.to); typeshed's _Wrapped is no descriptor, so
        # mypy wants `self` again and takes the dtype for it.
        model = LlamaForCausalLM(config).to(torch.bfloat16)  # type: ignore[arg-type]
    model.save_pretrained(path, safe_serialization=True)
    save_tokenizer(path, shape.vocab)
    return path
