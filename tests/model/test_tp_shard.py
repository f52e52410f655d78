"""TPShard: which heads, KV heads, MLP columns and vocabulary rows a rank holds; refusals."""

from __future__ import annotations

import pytest

from radixserve.config import ConfigError
from radixserve.model.arch import ModelArch, RopeSpec
from radixserve.model.tp_shard import TPShard, check_tp_size, valid_tp_sizes


def arch(heads: int, kv_heads: int, inter: int = 1536, vocab: int = 49152) -> ModelArch:
    return ModelArch("LlamaForCausalLM", vocab, 576, inter, 2, heads, kv_heads, 64, 1e-5,
                     RopeSpec(10000.0), 2048, True, False, None)


def test_smollm2_shape_is_refused_at_2_and_split_at_3() -> None:
    smollm2 = arch(9, 3)
    with pytest.raises(ConfigError) as err:
        check_tp_size(smollm2, 2)
    text = str(err.value)
    assert "tensor_parallel_size 2" in text and "9 attention heads" in text
    assert "Sizes this model allows: 1, 3" in text
    shards = [TPShard(r, 3, smollm2) for r in range(3)]
    assert [(s.num_heads, s.num_kv_heads, s.kv_head_start) for s in shards] == [
        (3, 1, 0), (3, 1, 1), (3, 1, 2)]
    assert [s.q_rows() for s in shards] == [slice(0, 192), slice(192, 384), slice(384, 576)]
    assert [s.mlp_rows() for s in shards][2] == slice(1024, 1536)
    assert shards[1].local_arch().num_heads == 3 and shards[1].local_arch().hidden_size == 576
    assert valid_tp_sizes(smollm2, 9) == [1, 3]


def test_fewer_kv_heads_than_ranks_are_replicated() -> None:
    spec = arch(8, 2, inter=64)
    shards = [TPShard(r, 4, spec) for r in range(4)]
    # Ranks 0, 1 hold KV head 0 (query heads 0-3), ranks 2, 3 KV head 1 (query heads 4-7).
    assert [(s.num_kv_heads, s.kv_head_start) for s in shards] == [(1, 0), (1, 0), (1, 1), (1, 1)]
    assert [s.kv_rows() for s in shards][3] == slice(64, 128)
    with pytest.raises(ConfigError, match="KV heads"):
        TPShard(0, 8, arch(24, 3, inter=48))  # 8 neither divides 3 nor is a multiple of it


def test_vocabulary_shards_cover_it_once_with_padding() -> None:
    spec = arch(4, 2, inter=128, vocab=259)
    ranges = [TPShard(r, 2, spec).vocab_range for r in range(2)]
    assert ranges == [(0, 130), (130, 259)]
    assert TPShard(1, 2, spec).vocab_per_rank == 130  # the last shard: 129 rows + 1 of zeros
    with pytest.raises(ConfigError, match="intermediate_size 130"):
        check_tp_size(arch(4, 2, inter=130), 4)
