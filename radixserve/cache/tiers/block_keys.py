"""Names and result types of the KV tiers: where a block lives, what computed it, its key.

Owns: the block key (a file-system-safe name that mixes the `/kv_events` chain hash with the
fingerprint of the model that computed the KV), and the enums / frozen results every store
returns. Does not know: files, memory, the radix tree, tensors (payloads are opaque bytes).

Why the fingerprint is in the key: the chain hash already covers every earlier token and the
tenant salt (kv_events.block_hashes), but not which model, dtype or page layout turned those
tokens into KV. Two replicas of different models sharing a directory must never see each
other's blocks as hits, so the key of a block is xxh3_128(chain hash || fingerprint digest).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import xxhash

from radixserve.cache.radix_types import Tier

KEY_HEX_LEN = 32  # block_key() is an xxh3_128 hex digest


@dataclass(frozen=True)
class Fingerprint:
    """What computed the KV: every field changes the bytes of a block."""

    model: str
    dtype: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int

    def canonical(self) -> str:
        # NOTE: field order and separators are part of the on-disk format; changing them turns
        # every existing block into a miss (safe, but a cold cache).
        return (f"radixserve-kv-v1|model={self.model}|dtype={self.dtype}"
                f"|layers={self.num_layers}|kv_heads={self.num_kv_heads}"
                f"|head_dim={self.head_dim}|block={self.block_size}")

    def digest(self) -> str:
        """Stable hex digest (xxh3_128 of the canonical string); 32 hex chars."""
        return xxhash.xxh3_128_hexdigest(self.canonical().encode("utf-8"))


def block_key(chain_hash: int, fp: Fingerprint) -> str:
    """The store key of the block whose kv_events chain hash is `chain_hash`, computed by `fp`.

    32 lowercase hex chars, usable as a file name on any file system.
    """
    if not 0 <= chain_hash < 1 << 64:
        raise ValueError(f"chain_hash must be an unsigned 64-bit int, got {chain_hash}")
    return xxhash.xxh3_128_hexdigest(chain_hash.to_bytes(8, "little") + fp.digest().encode())


def is_key(name: str) -> bool:
    """True if `name` has the shape of a block_key() result."""
    return len(name) == KEY_HEX_LEN and all(c in "0123456789abcdef" for c in name)


class StoreStatus(enum.Enum):
    STORED = "stored"
    EXISTS = "exists"  # the store already held the key; nothing written
    NO_SPACE = "no_space"  # the device is full (ENOSPC/EDQUOT) or the block exceeds capacity
    ERROR = "error"  # any other OSError; nothing left behind


class MissReason(enum.Enum):
    ABSENT = "absent"  # not in the index, or the file vanished
    CORRUPT = "corrupt"  # bad magic/version/checksum
    TRUNCATED = "truncated"  # shorter (or longer) than its header says
    WRONG_KEY = "wrong_key"  # a valid block of another key or fingerprint under this name
    IO_ERROR = "io_error"  # the read itself failed


@dataclass(frozen=True)
class LoadResult:
    """A hit (`data` set, `miss` None) or a miss (`data` None, `miss` says why)."""

    data: bytes | None
    miss: MissReason | None

    @property
    def hit(self) -> bool:
        return self.data is not None


@dataclass(frozen=True)
class TierStats:
    tier: Tier
    num_blocks: int
    bytes_used: int  # bytes of the indexed blocks as stored (headers included)
    capacity_bytes: int
    stored_bytes_total: int  # payload bytes written by put() since start
    loaded_bytes_total: int  # payload bytes returned by get() hits since start
    load_seconds_total: float
    store_seconds_total: float
    hits: int
    misses: int
    errors: dict[str, int] = field(default_factory=dict)  # kind -> count
