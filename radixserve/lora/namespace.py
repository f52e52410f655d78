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


def namespace_lora_name(namespace: str) -> str | None:
    """The adapter of a namespace (None: the base model); for KV events' `lora_name`."""
    parts = namespace.split(SEP)
    return parts[1].removeprefix("lora:") if len(parts) == 3 else None
