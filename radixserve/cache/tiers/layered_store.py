"""LayeredStore: the local tier on CUDA, host memory (HostStore, pinned) above the local disk.

Owns: how the two layers compose into one store: a block is written to both (host first, the
disk after it, on the writer thread), read from host memory when it is there and from the
disk otherwise. A block the host layer evicts stays on the disk, so host-memory pressure never
loses a block. The two layers are two places to read from (read_sources): host memory
(Tier.HOST) and the disk (Tier.LOCAL) each have their own load rate in the load-or-recompute
choice. Does not know: what a payload means, the tree.
"""

from __future__ import annotations

import torch

from radixserve.cache.tiers import BlockStore, HostStore, LoadResult, StoreStatus, Tier, TierStats
from radixserve.cache.tiers.block_io import Store

_OK = (StoreStatus.STORED, StoreStatus.EXISTS)


class LayeredStore:
    def __init__(self, host: HostStore, disk: BlockStore) -> None:
        self.host = host
        self.disk = disk
        self.tier = disk.tier

    def contains(self, key: str) -> bool:
        return self.host.contains(key) or self.disk.contains(key)

    def keys(self) -> list[str]:
        return sorted(set(self.host.keys()) | set(self.disk.keys()))

    def put(self, key: str, payload: bytes | memoryview) -> StoreStatus:
        on_host = self.host.put(key, payload)
        on_disk = self.disk.put(key, payload)
        if StoreStatus.STORED in (on_host, on_disk):
            return StoreStatus.STORED
        if on_host in _OK or on_disk in _OK:
            return StoreStatus.EXISTS
        return on_disk

    def get(self, key: str) -> LoadResult:
        result = self.host.get(key)
        return result if result.hit else self.disk.get(key)

    def get_buffer(self, key: str) -> torch.Tensor | None:
        """The host layer's pinned buffer (one async copy on CUDA); None: read the disk."""
        return self.host.get_buffer(key)

    def delete(self, key: str) -> None:
        self.host.delete(key)
        self.disk.delete(key)

    def take_evicted(self) -> list[str]:
        """Keys gone from both layers (the host layer's evictions alone lose nothing)."""
        gone = set(self.host.take_evicted()) | set(self.disk.take_evicted())
        return sorted(k for k in gone if not self.contains(k))

    def refresh(self, full: bool = True) -> None:
        self.disk.refresh(full)

    def stats(self) -> TierStats:
        """The disk's counters, with the host layer's loads added (a load is from either)."""
        d, h = self.disk.stats(), self.host.stats()
        errors = dict(d.errors)
        for kind, n in h.errors.items():
            errors[f"host_{kind}"] = errors.get(f"host_{kind}", 0) + n
        return TierStats(d.tier, d.num_blocks, d.bytes_used, d.capacity_bytes,
                         d.stored_bytes_total, d.loaded_bytes_total + h.loaded_bytes_total,
                         d.load_seconds_total + h.load_seconds_total, d.store_seconds_total,
                         d.hits + h.hits, d.misses, errors)

    def check_integrity(self) -> None:
        self.host.check_integrity()
        self.disk.check_integrity()


def read_sources(stores: dict[Tier, Store]) -> dict[Tier, Store]:
    """Where a block can be read from, fastest first: a LayeredStore's host layer as
    Tier.HOST ahead of its disk as Tier.LOCAL; every other store as itself."""
    out: dict[Tier, Store] = {}
    for tier, store in stores.items():
        if isinstance(store, LayeredStore):
            out[Tier.HOST] = store.host
            out[tier] = store.disk
        else:
            out[tier] = store
    return out
