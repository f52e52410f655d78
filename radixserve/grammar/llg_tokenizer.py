"""The tokenizer as llguidance sees it: each token's bytes, and which tokens are special.

Owns: building llguidance's tokenizer from an HF tokenizer so that an added token keeps the
`special` flag its tokenizer_config.json gives it. llguidance's own HF reader
(`llguidance.hf.from_tokenizer`) marks every added token special, and a special token never
matches grammar text: Qwen3's `<think>`, `</think>`, `<tool_call>` and `</tool_call>` (added,
not special) were then masked under every constraint, so a regex, a JSON schema or a tool-call
grammar could only spell `<tool_call>` byte by byte, which a real Qwen3 never does. Here an
added token that is not special is ordinary text (its bytes are its content) and a control
token (`<|im_end|>`, `<|endoftext|>`) stays special, as in the HF tokenizer itself.
Does not know: grammars, requests, torch.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from copy import copy

import llguidance
from llguidance.hf import from_tokenizer
from transformers import PreTrainedTokenizerBase


class TokenizerView:
    """What llguidance reads from a tokenizer object (its TokenizerWrapper protocol): every
    token's bytes, the special ids, EOS and BOS, and a call that tokenizes text. llguidance
    calls it on the decode path (the text a grammar forces next, about once per step of a
    JSON schema), so it goes straight to the Rust tokenizer (no padding, no truncation, as
    llguidance's own reader) and remembers the texts it has seen: schemas repeat them."""

    is_tokenizer_wrapper = True

    def __init__(self, tokenizer: PreTrainedTokenizerBase, tokens: list[bytes],
                 special_token_ids: list[int], eos_token_id: int) -> None:
        backend = copy(tokenizer.backend_tokenizer)
        backend.no_padding()
        backend.no_truncation()
        self._backend = backend
        self.tokens = tokens
        self.special_token_ids = special_token_ids
        self.eos_token_id = eos_token_id
        self.bos_token_id = tokenizer.bos_token_id
        self._encode = functools.lru_cache(maxsize=4096)(self._encode_text)  # per view

    def _encode_text(self, text: str) -> tuple[int, ...]:
        return tuple(self._backend.encode(text, add_special_tokens=False).ids)

    def __call__(self, text: str | bytes) -> list[int]:
        if isinstance(text, bytes):
            text = text.decode("utf-8", errors="replace")
        return list(self._encode(text))


def token_bytes(tokenizer: PreTrainedTokenizerBase, vocab_size: int
                ) -> tuple[list[bytes], list[int]]:
    """(bytes of each of `vocab_size` ids, the special ids). Ordinary tokens' bytes come from
    llguidance's own reader (byte-level and byte-fallback vocabularies both); an added token's
    are its content, marked special only where the tokenizer says it is. Ids past the
    tokenizer (a model's padded vocabulary) have no bytes: never allowed."""
    plain = from_tokenizer(tokenizer, n_vocab=vocab_size, slices=[])  # type: ignore[arg-type]
    n = min(vocab_size, len(tokenizer))
    tokens = [plain.decode_bytes([i]) for i in range(n)] + [b""] * (vocab_size - n)
    special = []
    for token_id, added in tokenizer.added_tokens_decoder.items():
        if token_id >= vocab_size:
            continue
        tokens[token_id] = added.content.encode("utf-8")
        if added.special:
            special.append(token_id)
    return tokens, special


def llg_tokenizer(tokenizer: PreTrainedTokenizerBase, vocab_size: int,
                  eos_token_ids: Sequence[int]) -> llguidance.LLTokenizer:
    """llguidance's tokenizer for `tokenizer` with added tokens read as the tokenizer means
    them; the grammar may end with any of `eos_token_ids`."""
    tokens, special = token_bytes(tokenizer, vocab_size)
    # An EOS is never text, even where a tokenizer left it unmarked: only the grammar's end
    # allows it (llguidance's EOS handling).
    special = sorted(set(special) | {e for e in eos_token_ids if e < vocab_size})
    view = TokenizerView(tokenizer, tokens, special, eos_token_ids[0])
    return llguidance.LLTokenizer(view, n_vocab=vocab_size,  # type: ignore[arg-type]
                                  eos_token=list(eos_token_ids))
