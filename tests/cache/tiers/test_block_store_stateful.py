"""Tier stores against a model: random put / get / delete / corrupt / restart interleavings, with
the LRU byte bound and take_evicted() predicted exactly, and check_integrity() after every step."""

from __future__ import annotations

import shutil
import tempfile
from collections import OrderedDict
from pathlib import Path

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from radixserve.cache.tiers import (
    BlockStore,
    HostStore,
    MissReason,
    StoreStatus,
    Tier,
    block_format,
    block_key,
)
from tests.cache.tiers.block_stores import FP

KEYS = [block_key(i * 1_000_003 + 7, FP) for i in range(6)]
SIZES = st.sampled_from([0, 10, 300, 700])
CAPACITY_BLOCKS = 3


class StoreMachine(RuleBasedStateMachine):
    """Model: key -> payload in recency order (oldest first), plus the evicted keys not yet
    taken. Sizes differ per block, so the byte bound decides how many fit."""

    def __init__(self) -> None:
        super().__init__()
        self.tmp = Path(tempfile.mkdtemp(prefix="tierstore-"))
        self.model: OrderedDict[str, bytes] = OrderedDict()
        self.evicted: list[str] = []
        # Shared tier: the last payload put under each key whose file may still be on disk (a
        # replica forgets, never deletes, a block written or read in the last minute).
        self.on_disk: dict[str, bytes] = {}

    @initialize(kind=st.sampled_from(["local", "shared", "host"]))
    def setup(self, kind: str) -> None:
        self.kind = kind
        self.capacity = CAPACITY_BLOCKS * self.size(KEYS[0], b"x" * 700)
        self.store = self.open()

    def open(self) -> BlockStore | HostStore:
        if self.kind == "host":
            return HostStore(self.capacity, FP)
        tier = Tier.SHARED if self.kind == "shared" else Tier.LOCAL
        return BlockStore(self.tmp, self.capacity, FP, tier, durable=False)

    def size(self, k: str, data: bytes) -> int:
        if getattr(self, "kind", "") == "host":
            return len(data)
        return block_format.stored_size(k, len(data))

    def teardown(self) -> None:
        shutil.rmtree(self.tmp, ignore_errors=True)

    @rule(k=st.sampled_from(KEYS), n=SIZES, fill=st.integers(0, 255))
    def put(self, k: str, n: int, fill: int) -> None:
        data = bytes([fill]) * n
        status = self.store.put(k, data)
        if k in self.model:
            assert status is StoreStatus.EXISTS
            return
        assert status is StoreStatus.STORED
        self.on_disk[k] = data
        used = sum(self.size(m, d) for m, d in self.model.items())
        while used + self.size(k, data) > self.capacity:
            old, old_data = self.model.popitem(last=False)
            used -= self.size(old, old_data)
            self.evicted.append(old)
        self.model[k] = data

    @rule(k=st.sampled_from(KEYS))
    def get(self, k: str) -> None:
        r = self.store.get(k)
        if k in self.model:
            assert r.data == self.model[k] and r.miss is None
            self.model.move_to_end(k)
        else:
            assert r.data is None and r.miss is MissReason.ABSENT

    @rule(k=st.sampled_from(KEYS))
    def delete(self, k: str) -> None:
        self.store.delete(k)
        self.model.pop(k, None)

    @precondition(lambda self: self.kind != "host" and bool(self.model))
    @rule(data=st.data())
    def corrupt(self, data: st.DataObject) -> None:
        assert isinstance(self.store, BlockStore)
        k = data.draw(st.sampled_from(sorted(self.model)))
        path = self.store.path(k)
        raw = bytearray(path.read_bytes())
        raw[data.draw(st.integers(0, len(raw) - 1))] ^= 0x5A
        path.write_bytes(bytes(raw))
        r = self.store.get(k)
        assert r.data is None and r.miss in (MissReason.CORRUPT, MissReason.TRUNCATED)
        del self.model[k]
        if self.kind == "shared":  # left on disk for its owner; gone from this index
            path.unlink()
            self.on_disk.pop(k, None)

    @precondition(lambda self: self.kind != "host")
    @rule()
    def restart(self) -> None:
        """A new process on the same directory: same blocks (recency from mtimes, which tie
        within a run, so only the set is compared)."""
        self.assert_evicted()
        self.store = self.open()
        if self.kind == "shared":
            self._adopt_shared_scan()
            return
        assert sorted(self.store.keys()) == sorted(self.model)
        for k in sorted(self.model):  # a defined recency for the model to follow
            assert self.store.get(k).data == self.model[k]
            self.model.move_to_end(k)

    def _adopt_shared_scan(self) -> None:
        """The shared tier's files may outlive its index (an evicted block whose mtime is not
        the one this store set, as after the test rewrote it, is held, not deleted), and
        their mtimes tie within a run, so a restart keeps any of them within the bound: each
        must hold its last payload, and the model follows."""
        self.store.take_evicted()  # the scan's own trimming: not the model's evictions
        keys = sorted(self.store.keys())
        assert set(keys) <= set(self.on_disk)
        self.model = OrderedDict()
        for k in keys:
            assert self.store.get(k).data == self.on_disk[k]
            self.model[k] = self.on_disk[k]

    @rule()
    def take(self) -> None:
        self.assert_evicted()

    def assert_evicted(self) -> None:
        assert self.store.take_evicted() == self.evicted
        self.evicted = []

    @invariant()
    def agrees(self) -> None:
        if not hasattr(self, "store"):
            return
        self.store.check_integrity()
        assert self.store.keys() == list(self.model)
        used = sum(self.size(k, d) for k, d in self.model.items())
        assert self.store.stats().bytes_used == used <= self.capacity


TestStoreMachine = StoreMachine.TestCase
TestStoreMachine.settings = settings(max_examples=60, stateful_step_count=30, deadline=None)
