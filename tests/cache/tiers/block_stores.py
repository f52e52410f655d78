"""The block-store tests' shared data: fingerprint, keys, payloads, block size, a store.

One fingerprint, deterministic keys and payloads, the stored size of one block, and a
non-durable store bounded in blocks.

Owns: what the block-store tests (unit, processes, stateful model) write and how they open a
store. Does not know: what any test asserts. Subprocess scripts import it too, so it stays
free of pytest.
"""

from __future__ import annotations

from pathlib import Path

from radixserve.cache.tiers import BlockStore, Fingerprint, Tier, block_format, block_key

FP = Fingerprint("smollm2-135m", "float32", 30, 3, 64, 16)
PAYLOAD = 1000


def key(i: int, fp: Fingerprint = FP) -> str:
    return block_key(0x9E3779B97F4A7C15 * (i + 1) % (1 << 64), fp)


def payload(i: int, n: int = PAYLOAD) -> bytes:
    return bytes((i * 7 + j) % 251 for j in range(n))


BLOCK = block_format.stored_size(key(0), PAYLOAD)  # bytes one PAYLOAD-sized block takes


def store(root: Path, blocks: int = 8, tier: Tier = Tier.LOCAL, **kw: object) -> BlockStore:
    """A store at `root` holding `blocks` PAYLOAD-sized blocks; no fsync (tests are fast)."""
    return BlockStore(root, blocks * BLOCK, FP, tier, durable=False, **kw)  # type: ignore[arg-type]
