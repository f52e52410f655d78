"""The engine's view of a request, and the batch the scheduler hands to the model runner.

Owns: Req (mutable; only the scheduler and its MemoryManager write it), ReqStatus, Batch.
Does not know: HTTP, tokenizers, tensors. Req compares by identity (eq=False): two requests
with equal fields are still two requests, and `req in list` must not compare token lists.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from radixserve.types import FinishReason, Phase, SamplingParams

if TYPE_CHECKING:
    from radixserve.cache.radix_cache import TreeNode


class ReqStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Req:
    """One request inside the engine. Only the scheduler mutates it.

    Layout of `token_ids`: [prompt ... | output ...]; `cached_len` tokens of it have KV in
    the pool (either matched from the radix tree or computed by this request). The slots of
    those tokens are in `slots[:cached_len]`; `slots[:prefix_len]` belong to the tree (locked
    through `cache_node`), the rest are held by this request.
    """

    rid: str
    token_ids: list[int]
    num_prompt_tokens: int
    params: SamplingParams
    max_new_tokens: int  # resolved: params.max_tokens capped by the context
    cache_salt: str = ""
    priority: int = 0  # lower = more important: admitted first, preempted last, cache kept longer
    arrival: float = 0.0
    status: ReqStatus = ReqStatus.WAITING
    cached_len: int = 0
    prefix_len: int = 0  # tokens whose slots are owned by the tree (locked)
    num_cached_tokens: int = 0  # prompt tokens served from the cache on first admission
    table_row: int = -1  # NOTE: -1 only while not running; asserted on use
    cache_node: TreeNode | None = None
    finish_reason: FinishReason | None = None
    num_preemptions: int = 0
    slots: list[int] = field(default_factory=list)
    stats_counted: bool = False  # its prompt entered the prefix-cache counters (first admission)
    num_skips: int = 0  # admission rounds it was passed over (the policy's age guard reads it)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def extend_len(self) -> int:
        """Tokens still without KV (the next forward must compute them)."""
        return self.num_tokens - self.cached_len

    @property
    def remain_tokens(self) -> int:
        return self.max_new_tokens - self.num_output_tokens


@dataclass(eq=False)
class Batch:
    """What the scheduler hands to the model runner for one forward.

    For EXTEND, request i computes tokens [reqs[i].cached_len, + extend_lens[i]) and samples
    only when `sample[i]` (its last chunk). For DECODE, every request computes one token.
    """

    phase: Phase
    reqs: list[Req]
    extend_lens: list[int]
    sample: list[bool]

    @property
    def size(self) -> int:
        return len(self.reqs)

    @property
    def num_tokens(self) -> int:
        return sum(self.extend_lens)
