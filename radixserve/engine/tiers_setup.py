"""Building the KV tiers of an engine from its config and its model runner.

Owns: the fingerprint of what computes the KV (model identity, dtype, layout), the tier sizes
in bytes, and the pool's medium name in kv_events. Does not know: the tree, the scheduler.
"""

from __future__ import annotations

from pathlib import Path

import torch
import xxhash

from radixserve.cache.tiers.block_io import KVCodec
from radixserve.cache.tiers.kv_tiers import KVTiers, fingerprint
from radixserve.cache.tiers.tier_types import TierSettings
from radixserve.config import EngineConfig
from radixserve.engine.model_runner import ModelRunner
from radixserve.kv_events.publisher import MEDIUM_CPU, MEDIUM_GPU

GIB = 1 << 30


def pool_medium(device: torch.device) -> str:
    return MEDIUM_GPU if device.type == "cuda" else MEDIUM_CPU


SAMPLE_HEAD = 1 << 20  # a weight file's first MiB: the safetensors/GGUF header and more
SAMPLE_CHUNK = 64 << 10  # then this much at SAMPLE_POINTS evenly spaced offsets
SAMPLE_POINTS = 16


def weights_sample_digest(path: Path, h: xxhash.xxh64) -> None:
    """Feed `h` a weight file's name, size and sampled bytes. A fine-tune of the same shapes
    has the same names and sizes but other bytes everywhere, so a sample tells them apart
    without reading gigabytes at start-up."""
    size = path.stat().st_size
    h.update(f"{path.name}:{size};".encode())
    with open(path, "rb") as f:
        h.update(f.read(SAMPLE_HEAD))
        for i in range(1, SAMPLE_POINTS + 1):
            f.seek(max(0, size * i // SAMPLE_POINTS - SAMPLE_CHUNK))
            h.update(f.read(SAMPLE_CHUNK))


def model_identity(name: str, hf_dir: Path) -> str:
    """The model's name plus a digest of its config and weight files: two models with one
    name but other weights (a fine-tune with the same shapes) never share blocks."""
    h = xxhash.xxh64()
    config = hf_dir / "config.json"
    if config.is_file():
        h.update(config.read_bytes())
    for path in sorted(hf_dir.iterdir()):
        if path.suffix in (".safetensors", ".gguf", ".bin") and path.is_file():
            weights_sample_digest(path, h)
    return f"{name}#{h.hexdigest()}"


def kv_format_identity(runner: ModelRunner) -> str:
    """"" for a pool in the model's dtype (the fingerprint of every existing block stays as it
    was); for an 8-bit pool its format and a digest of its scales: bytes stored with other
    scales, or in another format, are other bytes, so a tier never hands them over."""
    pool = runner.pool
    if pool.k_scale is None or pool.v_scale is None:
        return ""
    h = xxhash.xxh64()
    h.update(pool.k_scale.cpu().numpy().tobytes())
    h.update(pool.v_scale.cpu().numpy().tobytes())
    return f"|kv={str(pool.dtype).removeprefix('torch.')}#{h.hexdigest()}"


def build_tiers(cfg: EngineConfig, runner: ModelRunner) -> KVTiers | None:
    if not cfg.kv_tiers_enabled:
        return None
    spec = runner.spec
    identity = model_identity(runner.resolved.name, runner.resolved.hf_dir) + kv_format_identity(
        runner)
    fp = fingerprint(identity, runner.dtype, spec.num_layers, spec.num_kv_heads, spec.head_dim)
    settings = TierSettings(
        local_dir=None if cfg.kv_offload_dir is None else Path(cfg.kv_offload_dir),
        local_bytes=int(cfg.kv_offload_size * GIB),
        shared_dir=None if cfg.kv_shared_dir is None else Path(cfg.kv_shared_dir),
        shared_bytes=int(cfg.kv_shared_size * GIB), write_policy=cfg.kv_offload_write_policy,
        host_bytes=int(cfg.kv_offload_host_size * GIB) if runner.device.type == "cuda" else 0)
    return KVTiers(settings, fp, KVCodec(runner.pool.k, runner.pool.v), cfg.enable_kv_events)
