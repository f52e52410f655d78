"""Shared tree prefixes in a batch, and a plain decode step's inputs that stay fixed while
its running set does.

Owns: finding the requests of a batch whose first slots are the same tree pages (a backend
that reads them attends such a prefix once for the group), and DecodeFixed, built once per
running set. Does not know: the radix tree (only the slots requests already hold), the
model, the slot table.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np
import torch

from radixserve.attention.base import SharedPrefix
from radixserve.sched.decode import DecodeRows
from radixserve.sched.req import Req

MIN_SHARED_PREFIX = 64  # shorter shared prefixes are cheaper to attend per request


def find_shared_prefixes(reqs: list[Req]) -> list[tuple[list[int], int]]:
    """Groups of batch indices whose first S slots are the same tree pages, with S.

    Only tree-owned slots (req.slots[:num_tree_tokens]) are compared: they cannot change while
    the request runs, and equal slots mean equal KV.
    """
    by_first: dict[int, list[int]] = {}
    for b, r in enumerate(reqs):
        if r.num_tree_tokens >= MIN_SHARED_PREFIX:
            by_first.setdefault(r.slots[0], []).append(b)
    groups = []
    for members in by_first.values():
        if len(members) < 2:
            continue
        length = min(reqs[b].num_tree_tokens for b in members)
        block = np.array([reqs[b].slots[:length] for b in members])  # (n, length)
        same = (block == block[0]).all(axis=0)
        if not same.all():
            length = int(same.argmin())
        if length >= MIN_SHARED_PREFIX:
            groups.append((members, length))
    return groups


def shared_prefixes(reqs: list[Req], enabled: bool, dev: torch.device
                    ) -> tuple[list[SharedPrefix], list[int]]:
    """The batch's groups of requests over the same tree pages, and where each request's
    own part starts (0 outside any group); none unless `enabled` (a backend that reads them)."""
    shared: list[SharedPrefix] = []
    own_start = [0] * len(reqs)
    if len(reqs) > 1 and enabled:
        for members, length in find_shared_prefixes(reqs):
            slots = reqs[members[0]].slots[:length]
            consecutive = slots[-1] - slots[0] == length - 1 and all(
                b - a == 1 for a, b in itertools.pairwise(slots))
            shared.append(SharedPrefix(
                members=torch.tensor(members, dtype=torch.int64, device=dev),
                slots=torch.tensor(slots, dtype=torch.int64, device=dev),
                length=length, members_cpu=tuple(members),
                first_slot=slots[0] if consecutive else None))
            for b in members:
                own_start[b] = length
    return shared, own_start


@dataclass(frozen=True)
class DecodeFixed:
    """The inputs of a plain decode step that stay fixed while its running set does."""

    rows: DecodeRows  # the scheduler's view these were built from
    rows_t: torch.Tensor  # (B,) int64 table rows
    ones: torch.Tensor  # (B,) int32: one new token each
    ones_cpu: tuple[int, ...]
    cu: torch.Tensor  # (B + 1,) int32 token offsets
    arange: torch.Tensor  # (B,) int64: every token row samples
    rows_cpu: tuple[int, ...]
    shared: tuple[SharedPrefix, ...]  # tree pages do not change while a request decodes
    own_start: torch.Tensor  # (B,) int64
    own_start_cpu: tuple[int, ...]
    base_only: bool  # no request has an adapter (a request's adapter is set before it runs)

    @staticmethod
    def build(rows: DecodeRows, read_shared: bool, dev: torch.device) -> DecodeFixed:
        n = len(rows.reqs)
        shared, own_start = shared_prefixes(rows.reqs, read_shared, dev)
        return DecodeFixed(
            rows, torch.tensor(rows.rows, dtype=torch.int64, device=dev),
            torch.ones(n, dtype=torch.int32, device=dev), (1,) * n,
            torch.arange(n + 1, dtype=torch.int32, device=dev),
            torch.arange(n, dtype=torch.int64, device=dev), tuple(rows.rows), tuple(shared),
            torch.tensor(own_start, dtype=torch.int64, device=dev), tuple(own_start),
            all(r.lora is None for r in rows.reqs))
