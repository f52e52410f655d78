"""One step's StepInputs as a single int64 payload, so that rank 0 broadcasts it in one collective.

Owns: the payload's layout (pack_step on rank 0, unpack_step on a tensor-parallel worker).
What a worker can derive it rebuilds (seq_lens, cu_extend, the token rows of the table
writes) instead of receiving. Does not know: requests, the model, the process group.

Layout (all int64, on the device):
  [phase, max_seq_len, max_extend_len, B, T, N, W, G]   the counts (see below)
  G x [n_members, length, has_first_slot, first_slot]    the decode step's shared prefixes
  rows (B) | prefix_lens (B) | extend_lens (B) | own_start (B)
  input_ids (T) | positions (T) | out_slots (T) | logit_rows (N)
  table_back (3 * W: rows, positions, slots)
  per shared prefix: members (n_members) | slots (length)
"""

from __future__ import annotations

import torch

from radixserve.attention.base import AttentionMetadata, SharedPrefix
from radixserve.engine.step_inputs import StepInputs
from radixserve.types import Phase

_PHASES = list(Phase)
_NUM_COUNTS = 8
_GROUP_LEN = 4


def pack_step(inputs: StepInputs) -> torch.Tensor:
    """Rank 0: the payload every worker needs to run the same forward on its shard."""
    m = inputs.meta
    back = inputs.table_back
    num_back = 0 if back is None else back.shape[1]
    head = [_PHASES.index(m.phase), m.max_seq_len, m.max_extend_len, m.batch_size,
            inputs.input_ids.numel(), inputs.logit_rows.numel(), num_back, len(m.shared)]
    for g in m.shared:
        head += [len(g.members_cpu), g.length, int(g.first_slot is not None),
                 g.first_slot or 0]
    own = m.own_start_cpu or (0,) * m.batch_size
    head += [*m.rows_cpu, *m.prefix_lens_cpu, *m.extend_lens_cpu, *own]
    dev = inputs.input_ids.device
    parts = [torch.tensor(head, dtype=torch.int64).to(dev, non_blocking=True),
             inputs.input_ids, inputs.positions, m.out_slots, inputs.logit_rows]
    if back is not None:
        parts.append(back.reshape(-1))
    for g in m.shared:
        parts += [g.members, g.slots]
    return torch.cat([p.to(torch.int64) for p in parts])


class _Reader:
    """Consecutive slices of the payload, on the device and (host copies) as ints."""

    def __init__(self, payload: torch.Tensor) -> None:
        self.dev = payload
        self.host = payload.cpu()  # one copy per step (a no-op on CPU)
        self.at = 0

    def take(self, n: int) -> torch.Tensor:
        t = self.dev[self.at : self.at + n]
        self.at += n
        return t

    def ints(self, n: int) -> list[int]:
        values: list[int] = self.host[self.at : self.at + n].tolist()
        self.at += n
        return values

    def both(self, n: int) -> tuple[torch.Tensor, list[int]]:
        """The next n values on the device and as ints (a worker needs both forms)."""
        return self.dev[self.at : self.at + n], self.ints(n)


def unpack_step(payload: torch.Tensor, slot_table: torch.Tensor) -> StepInputs:
    """A worker: the StepInputs rank 0 packed, over this rank's own slot table."""
    r = _Reader(payload)
    phase, max_seq, max_extend, b, t, n, w, g = r.ints(_NUM_COUNTS)
    groups = [r.ints(_GROUP_LEN) for _ in range(g)]
    per_req_t, per_req = r.both(4 * b)  # rows, prefix_lens, extend_lens, own_start
    per_req_t = per_req_t.view(4, b)
    rows, prefix, extend, own = (per_req[i * b : (i + 1) * b] for i in range(4))
    prefix_t, extend_t = per_req_t[1].to(torch.int32), per_req_t[2].to(torch.int32)
    input_ids, positions, out_slots, logit_rows = r.take(t), r.take(t), r.take(t), r.take(n)
    back = r.take(3 * w).view(3, w) if w else None
    shared = []
    for num_members, length, has_first, first in groups:
        members_t, members = r.both(num_members)
        shared.append(SharedPrefix(members_t, r.take(length), length, tuple(members),
                                   first if has_first else None))
    cu = torch.zeros(b + 1, dtype=torch.int32, device=payload.device)
    cu[1:] = torch.cumsum(extend_t, 0)
    meta = AttentionMetadata(
        phase=_PHASES[phase], slot_table=slot_table, rows=per_req_t[0], prefix_lens=prefix_t,
        extend_lens=extend_t, seq_lens=prefix_t + extend_t, cu_extend=cu, out_slots=out_slots,
        prefix_lens_cpu=tuple(prefix), extend_lens_cpu=tuple(extend), max_seq_len=max_seq,
        max_extend_len=max_extend, rows_cpu=tuple(rows), shared=tuple(shared),
        own_start=per_req_t[3], own_start_cpu=tuple(own))
    return StepInputs(input_ids, positions, meta, logit_rows, back)
