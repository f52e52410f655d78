"""Which block hash the KV events carry: radixserve's xxh64 chain or vLLM's `sha256_cbor`.

Owns: the HashAlgo names (vLLM's `--prefix-caching-hash-algo` values we speak) and vLLM's
sha256_cbor chain, so that an indexer that recomputes vLLM's hashes from prompts (llm-d's
kv-cache manager, Dynamo's router) reads our events as a vLLM replica's. Does not know: the
events themselves (publisher.py), which cache holds what.

vLLM's scheme (vllm/v1/core/kv_cache_utils.py, as of 0.32; pinned by
tests/kv_events/test_block_hash.py against vectors made with vLLM's own function):

    sha256_cbor(x)  = sha256(cbor2.dumps(x, canonical=True)).digest()         # 32 bytes
    NONE_HASH       = sha256_cbor("vllm-none-hash")      # the seed, PYTHONHASHSEED unset
    h_i             = sha256_cbor((h_{i-1} or NONE_HASH, tuple(block_i's token ids), extra_i))
    extra_i         = (lora_name,) + ((salt,) for block 0 when a cache salt is set), None if
                      empty   # vLLM's LoRA and `cache_salt` extra keys (LoRA first, in every
                      block); no multimodal or prompt-embeds keys here. A LoRA namespace
                      (radixserve/lora/namespace.py) gives both parts.
    on the wire     = int.from_bytes(h_i[-8:], "big")    # VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES

Only full blocks have a hash. The chain runs on the full 32-byte digests; events, the router's
index and our tiers see the 64-bit wire form, as vLLM's int-hash events do.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import cbor2

from radixserve.lora.namespace import split_namespace

NONE_HASH_SEED = "vllm-none-hash"


def sha256_cbor(value: object) -> bytes:
    return hashlib.sha256(cbor2.dumps(value, canonical=True)).digest()


NONE_HASH = sha256_cbor(NONE_HASH_SEED)


def wire_hash(digest: bytes) -> int:
    """The 64-bit int an event carries for a 32-byte block hash (vLLM's int form)."""
    return int.from_bytes(digest[-8:], "big")


def sha256_cbor_digests(token_ids: Sequence[int], block_size: int,
                        salt: str = "") -> list[bytes]:
    """vLLM's full block hashes of `token_ids` (module docstring); raises ValueError for a
    block size < 1."""
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    parent = NONE_HASH
    out: list[bytes] = []
    salt, lora = split_namespace(salt)
    lora_keys = () if lora is None else (lora,)
    for i in range(len(token_ids) // block_size):
        block = tuple(int(t) for t in token_ids[i * block_size : (i + 1) * block_size])
        keys = lora_keys + ((salt,) if salt and i == 0 else ())
        extra = keys or None
        parent = sha256_cbor((parent, block, extra))
        out.append(parent)
    return out


def sha256_cbor_hashes(token_ids: Sequence[int], block_size: int, salt: str = "") -> list[int]:
    return [wire_hash(d) for d in sha256_cbor_digests(token_ids, block_size, salt)]
