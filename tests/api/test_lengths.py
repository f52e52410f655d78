"""radixserve/api/lengths.py's rules as the server's job builder (api/jobs.py) applies them:
the two context-length messages in OpenAI's wording, with their parameter and code, and the
seed of choice i. Torch-free."""

from __future__ import annotations

import pytest

from radixserve.api.errors import APIError
from radixserve.api.jobs import JobCaps, finalize_params
from radixserve.api.lengths import (
    choice_seed,
    context_length_message,
    prompt_too_long_message,
    wrap_int64,
)
from radixserve.types import SamplingParams

CAPS = JobCaps(max_model_len=64, vocab_size=100, max_tokens_cap=None, max_input_tokens=None)


def test_a_prompt_that_fills_the_context_is_a_400_naming_the_prompt() -> None:
    with pytest.raises(APIError) as e:
        finalize_params(CAPS, SamplingParams(), 64, "messages")
    assert (e.value.status, e.value.param, e.value.code) == (400, "messages",
                                                             "context_length_exceeded")
    assert e.value.message == prompt_too_long_message(64, 64)
    assert e.value.message == ("This model's maximum context length is 64 tokens. However, "
                               "the prompt has 64 tokens.")


def test_max_tokens_past_the_context_is_a_400_naming_max_tokens() -> None:
    with pytest.raises(APIError) as e:
        finalize_params(CAPS, SamplingParams(max_tokens=10), 60, "prompt")
    assert (e.value.status, e.value.param, e.value.code) == (400, "max_tokens",
                                                             "context_length_exceeded")
    assert e.value.message == context_length_message(64, 60, 10)
    assert "requested 70 tokens (60 in the prompt, 10 in the completion)" in e.value.message


def test_max_tokens_none_becomes_the_room_left() -> None:
    assert finalize_params(CAPS, SamplingParams(max_tokens=None), 60, "prompt").max_tokens == 4


def test_choice_seed_is_seed_plus_index_wrapped_into_int64() -> None:
    assert choice_seed(None, 3) is None
    assert choice_seed(5, 2) == 7
    assert choice_seed(2**63 - 1, 1) == -(2**63) == wrap_int64(2**63)
