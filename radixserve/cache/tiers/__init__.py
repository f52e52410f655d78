"""KV tiers below the pool: the block key, the result types, and the stores.

Owns nothing itself; re-exports keys.py (Tier, Fingerprint, block_key, StoreStatus,
MissReason, LoadResult, TierStats), BlockStore (a directory: the local or the shared tier)
and HostStore (host memory, pinned on CUDA). Does not know the radix tree, which decides
what goes where.
"""

from radixserve.cache.tiers.block_store import BlockStore
from radixserve.cache.tiers.host_store import HostStore
from radixserve.cache.tiers.keys import (
    Fingerprint,
    LoadResult,
    MissReason,
    StoreStatus,
    Tier,
    TierStats,
    block_key,
)

__all__ = ["BlockStore", "Fingerprint", "HostStore", "LoadResult", "MissReason", "StoreStatus",
           "Tier", "TierStats", "block_key"]
