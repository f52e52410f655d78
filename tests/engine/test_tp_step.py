"""tp_step.py: a step's StepInputs survive pack -> unpack field for field (what a worker runs)."""

from __future__ import annotations

import torch

from radixserve.attention.base import AttentionMetadata, SharedPrefix
from radixserve.engine.step_inputs import StepInputs, back_writes, write_slot_table
from radixserve.engine.tp_step import pack_step, unpack_step
from radixserve.types import Phase


def i64(values: list[int]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64)


def decode_step(table: torch.Tensor) -> StepInputs:
    prefix = [70, 71, 90]
    group = SharedPrefix(i64([0, 1]), torch.arange(100, 170), 70, (0, 1), 100)
    odd = SharedPrefix(i64([2]), i64([5, 9, 7]), 3, (2,), None)  # no first slot
    meta = AttentionMetadata(
        phase=Phase.DECODE, slot_table=table, rows=i64([4, 0, 2]),
        prefix_lens=torch.tensor(prefix, dtype=torch.int32),
        extend_lens=torch.ones(3, dtype=torch.int32),
        seq_lens=torch.tensor([71, 72, 91], dtype=torch.int32),
        cu_extend=torch.arange(4, dtype=torch.int32), out_slots=i64([300, 301, 302]),
        prefix_lens_cpu=tuple(prefix), extend_lens_cpu=(1, 1, 1), max_seq_len=91,
        max_extend_len=1, rows_cpu=(4, 0, 2), shared=(group, odd), own_start=i64([70, 70, 0]),
        own_start_cpu=(70, 70, 0))
    back = back_writes([(2, 0, [7, 8, 9]), (4, 68, [400, 401])], torch.device("cpu"))
    return StepInputs(i64([11, 12, 13]), i64(prefix), meta, i64([0, 1, 2]), back)


def test_a_decode_step_with_shared_prefixes_and_table_writes_round_trips() -> None:
    table, table2 = (torch.zeros(8, 128, dtype=torch.int32) for _ in range(2))
    step = decode_step(table)
    got = unpack_step(pack_step(step), table2)
    m, g = step.meta, got.meta
    assert g.slot_table is table2 and g.phase is Phase.DECODE
    for name in ("rows", "prefix_lens", "extend_lens", "seq_lens", "cu_extend", "out_slots",
                 "own_start"):
        a, b = getattr(m, name), getattr(g, name)
        assert a.dtype == b.dtype and torch.equal(a, b), name
    for name in ("prefix_lens_cpu", "extend_lens_cpu", "max_seq_len", "max_extend_len",
                 "rows_cpu", "own_start_cpu"):
        assert getattr(m, name) == getattr(g, name), name
    assert len(g.shared) == 2
    for a, b in zip(m.shared, g.shared, strict=True):
        assert torch.equal(a.members, b.members) and torch.equal(a.slots, b.slots)
        assert (a.length, a.members_cpu, a.first_slot) == (b.length, b.members_cpu, b.first_slot)
    for name in ("input_ids", "positions", "logit_rows", "table_back"):
        assert torch.equal(getattr(step, name), getattr(got, name)), name
    # The worker's table ends up as rank 0's.
    write_slot_table(table, m, step.positions, step.table_back)
    write_slot_table(table2, g, got.positions, got.table_back)
    assert torch.equal(table, table2) and table[2, :3].tolist() == [7, 8, 9]
    assert table[4, 68:71].tolist() == [400, 401, 300]


def test_a_prefill_step_without_table_writes_round_trips() -> None:
    table = torch.zeros(4, 64, dtype=torch.int32)
    meta = AttentionMetadata(
        phase=Phase.PREFILL, slot_table=table, rows=i64([1, 3]),
        prefix_lens=torch.tensor([0, 2], dtype=torch.int32),
        extend_lens=torch.tensor([3, 2], dtype=torch.int32),
        seq_lens=torch.tensor([3, 4], dtype=torch.int32),
        cu_extend=torch.tensor([0, 3, 5], dtype=torch.int32), out_slots=i64([9, 8, 7, 6, 5]),
        prefix_lens_cpu=(0, 2), extend_lens_cpu=(3, 2), max_seq_len=4, max_extend_len=3,
        rows_cpu=(1, 3), own_start=i64([0, 0]), own_start_cpu=(0, 0))
    step = StepInputs(i64([1, 2, 3, 4, 5]), i64([0, 1, 2, 2, 3]), meta, i64([2, 4]))
    got = unpack_step(pack_step(step), table)
    assert got.table_back is None and got.meta.phase is Phase.PREFILL and not got.meta.shared
    assert torch.equal(got.meta.cu_extend, meta.cu_extend)
    assert torch.equal(got.meta.seq_lens, meta.seq_lens)
    assert torch.equal(got.logit_rows, step.logit_rows)
