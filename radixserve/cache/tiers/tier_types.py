"""The tiers' settings and the hit a probe finds, as plain data.

kv_tiers.py, the scheduler's tier loads and the engine's set-up share them.

Owns: TierSettings (what the engine configured), TierHit (the blocks past a pool match that
the tiers hold, and where each is), PoolPaths (what persist() reads from the tree). Does not
know: stores, files, the tree.
"""

from __future__ import annotations

from array import array
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from radixserve.cache.radix_types import Tier
from radixserve.cache.tiers.block_io import BLOCK, MAX_PENDING_BYTES


class PoolPaths(Protocol):
    def pool_paths(self) -> Iterator[tuple[array[int], array[int], int, str]]: ...


@dataclass(frozen=True)
class TierSettings:
    local_dir: Path | None
    local_bytes: int
    shared_dir: Path | None
    shared_bytes: int
    write_policy: str = "write_back"
    host_bytes: int = 0  # > 0 (CUDA): a host-memory layer above the local disk
    durable: bool = True  # fsync every block (False: tests)
    max_pending_bytes: int = MAX_PENDING_BYTES  # captured writes not yet stored


@dataclass(frozen=True)
class TierHit:
    """Blocks past the pool match that the tiers hold, in order, consecutive."""

    start: int  # the pool match (tokens before it are in the pool)
    end: int  # the end of the last block held (a multiple of BLOCK)
    keys: tuple[str, ...]
    tiers: tuple[Tier, ...]
    probe: bool = False  # loaded to measure its tier (the choice would have recomputed)

    @property
    def num_tokens(self) -> int:
        return self.end - self.start

    def block_ends(self) -> list[int]:
        first = self.start // BLOCK
        return [(first + i + 1) * BLOCK for i in range(len(self.keys))]
