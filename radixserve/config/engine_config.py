"""EngineConfig: the engine process's settings, frozen and validated once at the edge.

Model, dtype, pool, scheduling, tiers, speculation.

Owns: validation of the engine's flags. Does not know: argparse (cli.py builds it), the
model's own config.json (model/arch.py reads it).
"""

from __future__ import annotations

import enum
import os
from dataclasses import dataclass
from typing import Any

from radixserve.config.lora_config import LoRAConfig
from radixserve.config.parsing import ConfigError, parse_byte_size
from radixserve.config.speculative_config import SpeculativeConfig

DTYPES = ("auto", "float32", "bfloat16", "float16")
# vLLM's names: auto stores K/V in the model's dtype; fp8 is fp8_e4m3 (attention/kv_quant.py)
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3", "fp8_e5m2")


class SchedulePolicy(enum.StrEnum):
    """Order of the waiting queue (sched/queue_policy.py); the values are the CLI's strings."""

    LPM = "lpm"  # longest prefix match first (with an age guard)
    FCFS = "fcfs"  # arrival order


SCHEDULE_POLICIES = tuple(p.value for p in SchedulePolicy)
ATTENTION_BACKENDS = ("auto", "torch", "triton")
# int8: weight int8, per output channel (model/quant.py); fp8: per-channel FP8 weights
# quantized at load (model/quantization/). A pre-quantized checkpoint needs no flag; its own
# method's name (awq, gptq, compressed-tensors, fp8) is accepted as a no-op, as vLLM does.
QUANTIZATIONS = ("int8", "fp8", "awq", "gptq", "compressed-tensors")
ONLINE_QUANTIZATIONS = ("int8", "fp8")  # those that quantize a float checkpoint at load
EVICTION_POLICIES = ("lru", "slru")
KV_OFFLOAD_WRITE_POLICIES = ("write_back", "write_through")
TIER_BLOCK_SIZE = 16  # tier blocks are kv_events' blocks


@dataclass(frozen=True)
class EngineConfig:
    model: str = "smollm2-135m"
    # auto: bfloat16 on CUDA, on CPUs with AMX, and on AVX512-BF16 CPUs where a start-up
    # matmul measures it faster than fp32; else float32 (model/auto_dtype.py)
    dtype: str = "auto"
    quantization: str | None = None  # one of QUANTIZATIONS (None: the checkpoint's own)
    device: str = "auto"  # auto: cuda if available else cpu
    max_model_len: int | None = None  # default: the model's max_position_embeddings (capped)
    kv_cache_tokens: int | None = None  # default: sized from free memory
    # vLLM's --kv-cache-memory-bytes: the pool's size in bytes (an int, or text with a K/M/G
    # suffix: lower case powers of 1000, upper case of 1024, as vLLM reads it); exclusive with
    # kv_cache_tokens
    kv_cache_memory_bytes: int | None = None
    kv_cache_dtype: str = "auto"  # KV_CACHE_DTYPES; fp8: 8-bit K/V with per-head scales
    page_size: int = 1
    max_running_requests: int = 256
    max_prefill_tokens: int = 8192  # token budget of one prefill batch
    chunked_prefill_size: int = 2048  # 0 disables chunking
    # While requests decode, prefill chunks (up to chunked_prefill_size tokens) share their
    # forward (MIXED steps); False: decode and prefill steps alternate.
    mixed_chunk: bool = True
    schedule_policy: SchedulePolicy = SchedulePolicy.LPM  # a string is parsed at the edge
    disable_radix_cache: bool = False
    attention_backend: str = "auto"
    # CUDA graphs for decode and draft-verify steps (engine/cuda_graph.py): SGLang's
    # --cuda-graph-max-bs is the largest batch captured (larger ones run eager), vLLM's
    # --enforce-eager captures none. Accepted on CPU, where no graph is used.
    cuda_graph_max_bs: int = 256
    enforce_eager: bool = False
    # Overlap scheduling (engine/overlap.py), SGLang's flag: on by default where the device
    # runs asynchronously (CUDA); `overlap_on_cpu` turns it on over a CPU device (tests, and
    # bench.overhead's simulated device), where a forward is synchronous.
    disable_overlap_schedule: bool = False
    overlap_on_cpu: bool = False
    seed: int = 0
    num_threads: int | None = None  # torch intra-op threads on CPU
    enable_kv_events: bool = False
    eviction_policy: str = "lru"  # slru: prefixes hit more than once outlive one-off prompts
    # Fraction of the KV pool a tenant (API key) may keep cached before eviction takes from it
    # first; None: no quotas.
    tenant_cache_quota: float | None = None
    # Pinned prefixes (POST /cache/pin) may lock at most this many tokens; None: a quarter of
    # the KV pool, so pins can never starve serving.
    max_pinned_tokens: int | None = None
    # vLLM's --speculative-config (JSON text or a dict here, parsed into SpeculativeConfig);
    # None: no server-wide drafting (a request's own `prediction` still drafts).
    speculative_config: SpeculativeConfig | None = None
    # Tiers below the pool (cache/tiers/kv_tiers.py). The local tier: files under this directory,
    # bounded by kv_offload_size GiB (on CUDA with host memory of kv_offload_host_size GiB
    # above the disk); the shared tier: a directory several replicas mount, written through.
    kv_offload_dir: str | None = None
    kv_offload_size: float = 16.0
    kv_shared_dir: str | None = None
    kv_offload_write_policy: str = "write_back"  # or write_through (bench/README.md)
    kv_offload_host_size: float = 4.0
    # False (vLLM's default, xgrammar's): a JSON schema's objects generate only the properties
    # they name unless they ask for more; True: JSON Schema's own default (grammar_text.py).
    structured_outputs_allow_additional_properties: bool = False
    kv_shared_size: float = 16.0  # this replica's bound on the shared tier (GiB)
    # A clean shutdown writes every pending tier block within this many seconds (or logs
    # how many it dropped).
    kv_offload_shutdown_timeout: float = 30.0
    # Tensor parallelism (engine/tp_ranks.py): the model's layers split over this many ranks
    # (processes on torch.distributed: gloo on CPU, NCCL on CUDA), SGLang's multi-node names.
    tensor_parallel_size: int = 1
    # A mixture-of-experts model's experts placed whole, E / N per rank, instead of every
    # expert sliced over the ranks (vLLM's --enable-expert-parallel; attention stays TP).
    enable_expert_parallel: bool = False
    nnodes: int = 1
    node_rank: int = 0
    dist_init_addr: str | None = None  # HOST:PORT of rank 0's rendezvous (several nodes)
    # Multi-LoRA serving (--enable-lora and its flags); None: off.
    lora: LoRAConfig | None = None

    @property
    def kv_tiers_enabled(self) -> bool:
        return self.kv_offload_dir is not None or self.kv_shared_dir is not None

    def __post_init__(self) -> None:
        for name in ("kv_offload_dir", "kv_shared_dir"):
            value = getattr(self, name)
            if value is not None:  # a Path is accepted (LLM(kv_offload_dir=tmp_path))
                object.__setattr__(self, name, os.fspath(value))
        self._parse_speculative()
        if self.dtype not in DTYPES:
            raise ConfigError(f"unsupported dtype {self.dtype!r}; supported: {', '.join(DTYPES)}")
        if self.quantization is not None and self.quantization not in QUANTIZATIONS:
            raise ConfigError(f"unsupported quantization {self.quantization!r}; supported: "
                              f"{', '.join(QUANTIZATIONS)} (or none)")
        if self.schedule_policy not in SCHEDULE_POLICIES:
            raise ConfigError(
                f"unknown schedule policy {self.schedule_policy!r}; "
                f"supported: {', '.join(SCHEDULE_POLICIES)}"
            )
        object.__setattr__(self, "schedule_policy", SchedulePolicy(self.schedule_policy))
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ConfigError(
                f"unknown attention backend {self.attention_backend!r}; "
                f"supported: {', '.join(ATTENTION_BACKENDS)}"
            )
        self._check_kv_cache()
        if self.page_size < 1:
            raise ConfigError(f"page_size must be >= 1, got {self.page_size}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ConfigError(f"max_model_len must be >= 2, got {self.max_model_len}")
        if self.kv_cache_tokens is not None and self.kv_cache_tokens < self.page_size:
            raise ConfigError(f"kv_cache_tokens must be >= page_size, got {self.kv_cache_tokens}")
        if self.max_running_requests < 1:
            raise ConfigError("max_running_requests must be >= 1")
        if (isinstance(self.cuda_graph_max_bs, bool) or not isinstance(self.cuda_graph_max_bs, int)
                or self.cuda_graph_max_bs < 1):
            raise ConfigError(f"cuda_graph_max_bs must be an integer >= 1, got "
                              f"{self.cuda_graph_max_bs!r} (--enforce-eager turns graphs off)")
        if self.max_prefill_tokens < 1:
            raise ConfigError("max_prefill_tokens must be >= 1")
        if self.eviction_policy not in EVICTION_POLICIES:
            raise ConfigError(f"unknown eviction policy {self.eviction_policy!r}; "
                              f"supported: {', '.join(EVICTION_POLICIES)}")
        if self.tenant_cache_quota is not None and not 0 < self.tenant_cache_quota <= 1:
            raise ConfigError(
                f"tenant_cache_quota must be in (0, 1], got {self.tenant_cache_quota}")
        if self.max_pinned_tokens is not None and self.max_pinned_tokens < 0:
            raise ConfigError(f"max_pinned_tokens must be >= 0, got {self.max_pinned_tokens}")
        if self.chunked_prefill_size < 0:
            raise ConfigError("chunked_prefill_size must be >= 0 (0 disables chunking)")
        self._check_tiers()
        self._check_parallel()

    def _check_parallel(self) -> None:
        tp, nodes = self.tensor_parallel_size, self.nnodes
        for name, value in (("tensor_parallel_size", tp), ("nnodes", nodes)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"{name} must be an integer >= 1, got {value!r}")
        if not 0 <= self.node_rank < nodes:
            raise ConfigError(f"node_rank must be in [0, nnodes - 1] = [0, {nodes - 1}], got "
                              f"{self.node_rank}")
        if tp % nodes:
            raise ConfigError(f"tensor_parallel_size {tp} must be a multiple of nnodes {nodes} "
                              "(the same number of ranks on every node)")
        if self.dist_init_addr is not None:
            host, _, port = self.dist_init_addr.rpartition(":")
            if not host or not port.isdigit() or not 0 < int(port) < 65536:
                raise ConfigError(f"dist_init_addr must be HOST:PORT, got "
                                  f"{self.dist_init_addr!r}")
        elif nodes > 1:
            raise ConfigError("--nnodes > 1 needs --dist-init-addr HOST:PORT (rank 0's node)")
        if tp == 1:
            return
        if self.lora is not None:
            raise ConfigError("--enable-lora is not supported with tensor_parallel_size > 1 yet")
        if self.kv_cache_dtype != "auto":
            raise ConfigError(f"kv_cache_dtype {self.kv_cache_dtype!r} is not supported with "
                              "tensor_parallel_size > 1 yet (its scales are per KV head of "
                              "the whole model); use the model's dtype (auto)")
        if self.kv_tiers_enabled:
            raise ConfigError("--kv-offload-dir / --kv-shared-dir are not supported with "
                              "tensor_parallel_size > 1 yet (each rank's pool holds only its "
                              "KV heads)")

    def _check_kv_cache(self) -> None:
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ConfigError(f"unsupported kv_cache_dtype {self.kv_cache_dtype!r}; supported: "
                              f"{', '.join(KV_CACHE_DTYPES)}")
        if self.kv_cache_memory_bytes is None:
            return
        value = parse_byte_size(self.kv_cache_memory_bytes, "kv_cache_memory_bytes")
        object.__setattr__(self, "kv_cache_memory_bytes", value)
        if value < 1:
            raise ConfigError(f"kv_cache_memory_bytes must be >= 1, got {value}")
        if self.kv_cache_tokens is not None:
            raise ConfigError("give the KV pool's size once: kv_cache_tokens or "
                              "kv_cache_memory_bytes, not both")

    def _check_tiers(self) -> None:
        sizes = {"kv_offload_size": self.kv_offload_size, "kv_shared_size": self.kv_shared_size,
                 "kv_offload_host_size": self.kv_offload_host_size}
        for name, gib in sizes.items():
            if not gib > 0:
                raise ConfigError(f"{name} must be > 0 GiB, got {gib}")
        if not self.kv_offload_shutdown_timeout >= 0:
            raise ConfigError(f"kv_offload_shutdown_timeout must be >= 0 s, got "
                              f"{self.kv_offload_shutdown_timeout}")
        if self.kv_offload_write_policy not in KV_OFFLOAD_WRITE_POLICIES:
            raise ConfigError(f"unknown kv_offload_write_policy "
                              f"{self.kv_offload_write_policy!r}; supported: "
                              f"{', '.join(KV_OFFLOAD_WRITE_POLICIES)}")
        if not self.kv_tiers_enabled:
            return
        if TIER_BLOCK_SIZE % self.page_size:
            raise ConfigError(f"--kv-offload-dir / --kv-shared-dir store {TIER_BLOCK_SIZE}-token "
                              f"blocks: page_size must divide {TIER_BLOCK_SIZE}, got "
                              f"{self.page_size}")
        if self.disable_radix_cache:
            raise ConfigError("--kv-offload-dir / --kv-shared-dir extend the radix cache: they "
                              "cannot be used with --disable-radix-cache")
        if self.kv_offload_dir is not None and self.kv_offload_dir == self.kv_shared_dir:
            raise ConfigError("--kv-offload-dir and --kv-shared-dir must be different "
                              "directories")

    def _parse_speculative(self) -> None:
        value: Any = self.speculative_config
        if value is None:
            return
        # Built once at the edge: the flag's JSON or the offline API's dict becomes the frozen
        # SpeculativeConfig (ConfigError when invalid).
        object.__setattr__(self, "speculative_config", SpeculativeConfig.parse(value))
