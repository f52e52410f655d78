"""The on-disk format of one KV block: header, payload, checksum.

Owns: encoding a block into the buffers written in one sequential call, and checking a whole
file read back. Does not know: paths, the index, what the payload bytes mean.

Layout (all integers little-endian):
    magic        4 bytes  b"RXKV"
    version      u16      FORMAT_VERSION
    key_len      u16      length of the key (ASCII)
    fp_digest    32 bytes the Fingerprint.digest() hex, ASCII
    payload_len  u64
    key          key_len bytes
    payload      payload_len bytes
    checksum     u64      xxh3_64 over everything above
A file that is shorter or longer than its header says is TRUNCATED; bad magic, version or
checksum is CORRUPT; a valid block of another key or fingerprint is WRONG_KEY.
"""

from __future__ import annotations

import struct

import xxhash

from radixserve.cache.tiers.block_keys import MissReason

MAGIC = b"RXKV"
FORMAT_VERSION = 1
_FIXED = struct.Struct("<4sHH32sQ")  # magic, version, key_len, fp_digest, payload_len
_CHECKSUM = struct.Struct("<Q")


def encode_header(key: str, fp_digest: str, payload_len: int) -> bytes:
    kb = key.encode("ascii")
    return _FIXED.pack(MAGIC, FORMAT_VERSION, len(kb), fp_digest.encode("ascii"), payload_len) + kb


def encode_checksum(header: bytes, payload: bytes | memoryview) -> bytes:
    h = xxhash.xxh3_64()
    h.update(header)
    h.update(payload)
    return _CHECKSUM.pack(h.intdigest())


def stored_size(key: str, payload_len: int) -> int:
    """Bytes on disk of a block with this key and payload length."""
    return _FIXED.size + len(key.encode("ascii")) + payload_len + _CHECKSUM.size


MIN_SIZE = _FIXED.size + _CHECKSUM.size


def decode(data: bytes, key: str, fp_digest: str) -> tuple[memoryview | None, MissReason | None]:
    """The payload of a whole file's bytes (a zero-copy view), or why it is not one."""
    if len(data) < _FIXED.size:
        return None, MissReason.TRUNCATED
    magic, version, key_len, digest, payload_len = _FIXED.unpack_from(data, 0)
    if magic != MAGIC or version != FORMAT_VERSION:
        return None, MissReason.CORRUPT
    body_end = _FIXED.size + key_len + payload_len
    if len(data) != body_end + _CHECKSUM.size:
        return None, MissReason.TRUNCATED
    view = memoryview(data)
    (checksum,) = _CHECKSUM.unpack_from(data, body_end)
    if xxhash.xxh3_64_intdigest(view[:body_end]) != checksum:
        return None, MissReason.CORRUPT
    stored_key = bytes(view[_FIXED.size : _FIXED.size + key_len])
    if stored_key != key.encode("ascii") or digest != fp_digest.encode("ascii"):
        return None, MissReason.WRONG_KEY
    return view[_FIXED.size + key_len : body_end], None
