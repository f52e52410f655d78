"""The length, range and seed rules every entry point applies to a request.

The HTTP server, the scheduler (radixserve/sched/request_rules.py) and the offline LLM call
these, so each rule is written once.

Owns: the context-length messages, the test that token ids index the vocabulary (with the
server's wording and the engine's), and the seed of choice i of a seeded request (seed + i,
wrapped into int64). Does not know: HTTP, tensors, caps per API key (jobs.py), queues.
"""

from __future__ import annotations

from collections.abc import Iterable

from radixserve.types import InvalidRequestError

INT64_SPAN = 2**64


def context_length_message(max_model_len: int, prompt_len: int, max_tokens: int) -> str:
    """Why a prompt plus its completion does not fit the model (OpenAI's wording)."""
    return (f"This model's maximum context length is {max_model_len} tokens. However, you "
            f"requested {prompt_len + max_tokens} tokens ({prompt_len} in the prompt, "
            f"{max_tokens} in the completion).")


def prompt_too_long_message(max_model_len: int, prompt_len: int) -> str:
    """Why a prompt leaves no room for even one completion token (OpenAI's wording)."""
    return (f"This model's maximum context length is {max_model_len} tokens. However, the "
            f"prompt has {prompt_len} tokens.")


def first_outside_vocab(ids: Iterable[int], vocab_size: int) -> int | None:
    """The first id that does not index a vocabulary of `vocab_size` tokens, or None."""
    return next((i for i in ids if i < 0 or i >= vocab_size), None)


def check_token_ids(ids: Iterable[int], vocab_size: int, param: str) -> None:
    """Token ids must index the model's vocabulary (an out-of-range id must never reach it).
    The HTTP server's wording; the caller has already rejected negative ids by name."""
    outside = first_outside_vocab(ids, vocab_size)
    if outside is not None:
        raise InvalidRequestError(f"token id {outside} is out of range: the vocabulary has "
                                  f"{vocab_size} tokens", param)


def check_ids_in_vocab(ids: Iterable[int], vocab_size: int, param: str) -> None:
    """As check_token_ids, in the engine's wording (`param` token ids must be in [0, V))."""
    outside = first_outside_vocab(ids, vocab_size)
    if outside is not None:
        raise InvalidRequestError(f"{param} token ids must be in [0, {vocab_size}), got "
                                  f"{outside}", param)


def wrap_int64(value: int) -> int:
    return (value + 2**63) % INT64_SPAN - 2**63


def choice_seed(seed: int | None, index: int) -> int | None:
    """The seed of choice `index` of a request seeded with `seed`: seed + index in int64."""
    return None if seed is None else wrap_int64(seed + index)
