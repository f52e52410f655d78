"""The adapter's part of the prefix-cache key: the radix namespace of (tenant salt, adapter).

Owns: the one rule that turns a tenant salt and a loaded adapter into the namespace string the
radix tree, the tiers' block keys and the KV events' hash chain are keyed by. Does not know:
the tree, weights.

The namespace is internal: the server derives tenant salts (hex digests of API keys) and the
engine adds the adapter; a client never writes it. A salt containing NUL is refused where
clients could give one (the offline `cache_salt`), so `salt + NUL + "lora:" + ...` can only be
produced by the engine (SGLang #24638: a client-settable key colliding with an adapter's).
The adapter part is its name and the digest of its weights: reloading other weights under the
same name never reads K/V computed under the old ones, and two replicas that load the same
files agree on the key (the router and the shared tier depend on that).
"""

from __future__ import annotations

import zlib

SEP = "\x00"


def check_client_salt(salt: str) -> str:
    """A client-given cache salt; raises ValueError if it could forge an adapter namespace."""
    if SEP in salt:
        raise ValueError("cache_salt must not contain NUL characters")
    return salt


def lora_namespace(salt: str, lora_name: str | None, digest: str | None) -> str:
    """The radix namespace of a request: the salt alone for the base model."""
    if lora_name is None:
        return salt
    assert digest, "a loaded adapter always has a digest"
    return f"{salt}{SEP}lora:{lora_name}{SEP}{digest}"


def split_namespace(namespace: str) -> tuple[str, str | None]:
    """(tenant salt, adapter name or None) of a radix namespace."""
    parts = namespace.split(SEP)
    if len(parts) == 3 and parts[1].startswith("lora:"):
        return parts[0], parts[1].removeprefix("lora:")
    return namespace, None


def routing_namespace(salt: str, lora_name: str | None) -> str:
    """What the KV events' hash chain and the router key a prefix by: the salt and the
    adapter's name, without the weights' digest (the router knows a request's `model`, not
    the digest; the radix tree and the tiers keep the digest)."""
    return salt if lora_name is None else f"{salt}{SEP}lora:{lora_name}"


def event_namespace(namespace: str) -> str:
    """A radix namespace in the KV events' form: routing_namespace of its parts."""
    return routing_namespace(*split_namespace(namespace))


def lora_int_id(lora_name: str) -> int:
    """The `lora_id` of vLLM's BlockStored for an adapter: a stable 31-bit id of its name
    (our adapters have no operator-given integer id; every replica derives the same one)."""
    return zlib.crc32(lora_name.encode("utf-8")) & 0x7FFFFFFF
