"""Read-only looks inside serving objects that only tests need (not part of their API).

Owns: num_live_blocks (the block hashes a KVEventPublisher believes are cached) and
num_in_flight (the engine requests an EngineClient is still listening to). Does not know:
anything it does not read; it never mutates what it probes.
"""

from __future__ import annotations

from radixserve.ipc.client import EngineClient
from radixserve.kv_events.publisher import KVEventPublisher, is_pool_medium


def num_live_blocks(publisher: KVEventPublisher) -> int:
    """Blocks the publisher believes are in the pool (tier media not counted)."""
    return sum(len(h) for medium, h in publisher._live.items() if is_pool_medium(medium))


def num_in_flight(client: EngineClient) -> int:
    return len(client._queues)
