"""The grammar backend: compile a Constraint against the tokenizer; per-sequence matchers.

Owns: CompiledGrammar (a matcher in its start state, cloned for each sequence) and Matcher
(one sequence's position in its grammar: fill its row of the batch bitmask, accept a token,
may it end, is it terminated, roll back).
Does not know: requests, batches, the scheduler, HTTP, how llguidance's view of the tokenizer
is built (llg_tokenizer.py). Compilation may be slow (hundreds of ms for big schemas):
callers run `compile` off the step loop (compiler.py).

Bitmask layout (llguidance's and xgrammar's): int32 (batch, ceil(vocab / 32)); bit j of word w
set <=> token 32 * w + j is allowed. EOS is set only where the grammar may end.
"""

from __future__ import annotations

from dataclasses import dataclass

import llguidance
import torch
from transformers import PreTrainedTokenizerBase

from radixserve.constraints import Constraint
from radixserve.grammar.grammar_text import grammar_text
from radixserve.grammar.llg_tokenizer import llg_tokenizer


class GrammarError(ValueError):
    """The constraint does not compile against this tokenizer (the request's 400)."""


def bitmask_width(vocab_size: int) -> int:
    return (vocab_size + 31) // 32


class Matcher:
    """One sequence's grammar state. Mutated only through accept/rollback (the scheduler)."""

    def __init__(self, inner: llguidance.LLMatcher) -> None:
        self._m = inner

    def fill_row(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the allowed-token bits of this sequence's next token into bitmask[row]."""
        v = bitmask[row]
        assert bitmask.dtype == torch.int32 and v.is_contiguous() and not v.is_cuda
        self._m.unsafe_compute_mask_ptr(v.data_ptr(), v.numel() * 4)

    def accept(self, token_id: int) -> bool:
        """Advance by one sampled token; False if the grammar rejects it (then in error)."""
        return bool(self._m.consume_token(token_id))

    def copy(self) -> Matcher:
        """An independent matcher in the same state (to look ahead along a draft)."""
        return Matcher(self._m.deep_copy())

    def forced_tokens(self) -> list[int]:
        """Tokens the grammar forces from here (jump-forward); empty when there is a choice.
        Changes nothing."""
        return list(self._m.compute_ff_tokens())

    def valid_prefix_len(self, tokens: list[int]) -> int:
        """How many leading tokens of `tokens` the grammar accepts from here; changes nothing."""
        return int(self._m.validate_tokens(tokens))

    def rollback(self, num_tokens: int) -> None:
        ok = self._m.rollback(num_tokens)
        assert ok, self._m.get_error()

    @property
    def terminated(self) -> bool:
        """Nothing may follow (the grammar ended, or EOS was accepted)."""
        return bool(self._m.is_stopped())

    @property
    def error(self) -> str:
        return self._m.get_error() if self._m.is_error() else ""


@dataclass(frozen=True)
class CompiledGrammar:
    key: str
    template: llguidance.LLMatcher  # start state; never advanced, only deep-copied

    def matcher(self) -> Matcher:
        return Matcher(self.template.deep_copy())


class GrammarBackend:
    """Compiles constraints for one tokenizer. `compile` is thread-safe (llguidance drops the
    GIL while building a grammar), so compiler.py runs it on worker threads."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, vocab_size: int,
                 eos_token_ids: tuple[int, ...], allow_additional_properties: bool = False
                 ) -> None:
        self.vocab_size = vocab_size
        self.allow_additional_properties = allow_additional_properties  # grammar_text.py
        self.tokenizer = llg_tokenizer(tokenizer, vocab_size, eos_token_ids)

    def compile(self, constraint: Constraint) -> CompiledGrammar:
        try:
            grammar = grammar_text(constraint, self.allow_additional_properties)
        except ValueError as err:
            raise GrammarError(str(err)) from None
        m = llguidance.LLMatcher(self.tokenizer, grammar, log_level=0)
        if m.is_error():
            raise GrammarError(m.get_error())
        return CompiledGrammar(constraint.key, m)
