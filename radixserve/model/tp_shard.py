"""TPShard: which slice of every weight one tensor-parallel rank holds (Megatron's split).

Owns: the divisibility rules (the refusal of a head count the ranks do not divide, as vLLM
refuses it), the per-rank head, KV head, MLP and vocabulary ranges, and the rank's own
ModelArch (its head and MLP counts). Does not know: processes, collectives, tensors.

Split of one decoder layer over N ranks (rank r):
- q rows: heads [r * H/N, (r + 1) * H/N) (column-parallel); k and v rows: KV heads
  [r * K/N, ...) when N divides K, else the one KV head r // (N / K) (replicated, as vLLM
  does when there are fewer KV heads than ranks), so each rank's query heads find their own
  KV head locally and its pool holds only those heads;
- o_proj columns: the rank's q heads (row-parallel: partial sums, one all-reduce);
- gate/up rows and down columns: intermediate [r * I/N, (r + 1) * I/N);
- a MoE layer (layers/moe_weights.py): every expert's gate/up rows and down columns
  [r * F/N, ...) like the MLP's, or with expert parallelism the experts
  [r * E/N, (r + 1) * E/N) whole; the router replicated; Qwen2-MoE's shared expert sliced;
- embedding and LM head rows: vocabulary [r * ceil(V/N), ...), the last shard padded with
  zero rows so that every rank's logits have one shape (the gather concatenates them).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from radixserve.config.parsing import ConfigError
from radixserve.model.arch import ModelArch
from radixserve.model.layers.moe_spec import moe_of
from radixserve.model.layers.moe_weights import ExpertPart, check_moe_parallel, expert_part


def _kv_fits(num_kv_heads: int, size: int) -> bool:
    return num_kv_heads % size == 0 or size % num_kv_heads == 0


def _has_dense_mlp(spec: ModelArch) -> bool:
    moe = moe_of(spec)
    return moe is None or len(moe.sparse_layers(spec.num_layers)) < spec.num_layers


def _moe_fits(spec: ModelArch, size: int, expert_parallel: bool) -> bool:
    moe = moe_of(spec)
    try:
        if moe is not None:
            check_moe_parallel(moe, size, expert_parallel)
    except ConfigError:
        return False
    return True


def valid_tp_sizes(spec: ModelArch, limit: int = 64, expert_parallel: bool = False
                   ) -> list[int]:
    """The tensor-parallel sizes up to `limit` this model's shapes allow."""
    return [n for n in range(1, limit + 1) if spec.num_heads % n == 0
            and _kv_fits(spec.num_kv_heads, n)
            and (spec.intermediate_size % n == 0 or not _has_dense_mlp(spec))
            and _moe_fits(spec, n, expert_parallel)]


def check_tp_size(spec: ModelArch, size: int, expert_parallel: bool = False) -> None:
    """Raises ConfigError when `size` ranks cannot split this model's heads, MLP or experts
    evenly (`expert_parallel`: experts placed whole, E / size per rank)."""
    moe = moe_of(spec)
    if moe is not None and expert_parallel and moe.num_experts % size:
        check_moe_parallel(moe, size, expert_parallel)  # its own message: E % N
    problems = []
    if spec.num_heads % size:
        problems.append(f"the model's {spec.num_heads} attention heads "
                        "(num_attention_heads) are not divisible by it")
    if not _kv_fits(spec.num_kv_heads, size):
        problems.append(f"its {spec.num_kv_heads} KV heads (num_key_value_heads) neither "
                        "divide by it nor divide it")
    if spec.intermediate_size % size and _has_dense_mlp(spec):
        problems.append(f"its intermediate_size {spec.intermediate_size} is not divisible by it")
    if moe is not None and not _moe_fits(spec, size, expert_parallel):
        try:
            check_moe_parallel(moe, size, expert_parallel)
        except ConfigError as err:
            problems.append(str(err))
    if problems:
        sizes = ", ".join(map(str, valid_tp_sizes(spec, 16, expert_parallel)))
        raise ConfigError(f"tensor_parallel_size {size} cannot split {spec.architecture}: "
                          f"{'; '.join(problems)}. Sizes this model allows: {sizes}")


@dataclass(frozen=True)
class TPShard:
    rank: int
    size: int
    spec: ModelArch  # the whole model's
    expert_parallel: bool = False  # a MoE model's experts whole, E / size per rank

    def __post_init__(self) -> None:
        check_tp_size(self.spec, self.size, self.expert_parallel)
        assert 0 <= self.rank < self.size, (self.rank, self.size)

    @property
    def num_heads(self) -> int:
        return self.spec.num_heads // self.size

    @property
    def num_kv_heads(self) -> int:
        return max(self.spec.num_kv_heads // self.size, 1)

    @property
    def kv_head_start(self) -> int:
        kv = self.spec.num_kv_heads
        return self.rank * kv // self.size if kv % self.size == 0 else self.rank // (
            self.size // kv)

    @property
    def intermediate_size(self) -> int:
        return self.spec.intermediate_size // self.size

    @property
    def vocab_per_rank(self) -> int:
        return -(-self.spec.vocab_size // self.size)

    @property
    def vocab_range(self) -> tuple[int, int]:
        """[start, end) of the vocabulary rows this rank holds (end - start may be short of
        vocab_per_rank on the last rank: the rest is zero padding)."""
        start = self.rank * self.vocab_per_rank
        return min(start, self.spec.vocab_size), min(start + self.vocab_per_rank,
                                                      self.spec.vocab_size)

    def q_rows(self) -> slice:
        d = self.spec.head_dim
        return slice(self.rank * self.num_heads * d, (self.rank + 1) * self.num_heads * d)

    def kv_rows(self) -> slice:
        d = self.spec.head_dim
        return slice(self.kv_head_start * d, (self.kv_head_start + self.num_kv_heads) * d)

    def mlp_rows(self) -> slice:
        n = self.intermediate_size
        return slice(self.rank * n, (self.rank + 1) * n)

    def expert_part(self) -> ExpertPart:
        """Which experts, and which rows of each, this rank holds (a MoE model's)."""
        moe = moe_of(self.spec)
        assert moe is not None, "not a mixture-of-experts model"
        return expert_part(moe, self.rank, self.size, self.expert_parallel)

    def local_arch(self) -> ModelArch:
        """The model as this rank's forward sees it: its heads, KV heads and MLP width (the
        hidden size and the vocabulary stay whole: the residual stream is replicated)."""
        return dataclasses.replace(self.spec, num_heads=self.num_heads,
                                   num_kv_heads=self.num_kv_heads,
                                   intermediate_size=self.intermediate_size)
