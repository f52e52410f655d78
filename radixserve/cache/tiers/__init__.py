"""KV tiers below the pool: the block key, the result types, and the stores.

Owns nothing itself; re-exports block_keys.py (Fingerprint, block_key, StoreStatus,
MissReason, LoadResult, TierStats), BlockStore (a directory: the local or the shared tier)
and HostStore (host memory, pinned on CUDA); Tier itself is the tree's (cache/radix_types.py). Does not know the radix tree, which decides
what goes where.
"""

from radixserve.cache.radix_types import Tier
from radixserve.cache.tiers.block_keys import (
    Fingerprint,
    LoadResult,
    MissReason,
    StoreStatus,
    TierStats,
    block_key,
)
from radixserve.cache.tiers.block_store import BlockStore
from radixserve.cache.tiers.host_store import HostStore

__all__ = ["BlockStore", "Fingerprint", "HostStore", "LoadResult", "MissReason", "StoreStatus",
           "Tier", "TierStats", "block_key"]
