"""Command line: `radixserve serve --model M ...` (also `python -m radixserve serve ...`).

Owns: the flags (named as vLLM / SGLang users expect), reading RADIXSERVE_API_KEY, and building
the frozen configs once. Does not know: HTTP or the engine (server.serve.run_server does).
Defaults live in config.py only: a flag left unset is simply not passed to the dataclass.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from typing import Any

from radixserve.config import (
    ATTENTION_BACKENDS,
    DTYPES,
    EVICTION_POLICIES,
    KV_CACHE_DTYPES,
    KV_OFFLOAD_WRITE_POLICIES,
    METRICS_COMPAT,
    QUANTIZATIONS,
    REASONING_PARSERS,
    SCHEDULE_POLICIES,
    TOOL_CALL_PARSERS,
    ConfigError,
    EngineConfig,
    KVEventsConfig,
    LoRAConfig,
    LoRAModule,
    ServerConfig,
    kv_events_config_from,
)

API_KEY_ENV = "RADIXSERVE_API_KEY"
RUNTIME_LORA_ENV = "VLLM_ALLOW_RUNTIME_LORA_UPDATING"  # vLLM's switch for the load/unload routes

# (flag, type, config field, help); every one optional, default from config.py.
_ENGINE_FLAGS: list[tuple[str, Any, str, str]] = [
    ("--dtype", str, "dtype", f"weights/activations dtype: {', '.join(DTYPES)}"),
    ("--quantization", str, "quantization", f"weight quantization: {' | '.join(QUANTIZATIONS)}"),
    ("--device", str, "device", "auto | cpu | cuda"),
    ("--max-model-len", int, "max_model_len", "context length (default: the model's)"),
    ("--kv-cache-tokens", int, "kv_cache_tokens", "KV pool size in tokens (default: from memory)"),
    ("--kv-cache-memory-bytes", str, "kv_cache_memory_bytes",
     "KV pool size in bytes, e.g. 512M or 2G (K/M/G: powers of 1024; k/m/g: of 1000)"),
    ("--kv-cache-dtype", str, "kv_cache_dtype",
     f"KV cache storage: {' | '.join(KV_CACHE_DTYPES)} (fp8 = fp8_e4m3; default auto: the "
     "model's dtype)"),
    ("--page-size", int, "page_size", "tokens per KV page"),
    ("--chunked-prefill-size", int, "chunked_prefill_size", "prefill chunk in tokens; 0: off"),
    ("--max-prefill-tokens", int, "max_prefill_tokens", "token budget of one prefill batch"),
    ("--max-running-requests", int, "max_running_requests", "running batch size cap"),
    ("--schedule-policy", str, "schedule_policy", f"{' | '.join(SCHEDULE_POLICIES)}"),
    ("--attention-backend", str, "attention_backend", f"{' | '.join(ATTENTION_BACKENDS)}"),
    ("--seed", int, "seed", "engine random seed"),
    ("--cuda-graph-max-bs", int, "cuda_graph_max_bs",
     "largest decode batch replayed from a CUDA graph (default 256; CUDA only)"),
    ("--num-threads", int, "num_threads", "torch CPU threads"),
    ("--eviction-policy", str, "eviction_policy", f"{' | '.join(EVICTION_POLICIES)} (default lru)"),
    ("--tenant-cache-quota", float, "tenant_cache_quota",
     "fraction of the KV pool one API key may keep cached before it is evicted first"),
    ("--speculative-config", str, "speculative_config",
     'speculative decoding as JSON, e.g. \'{"method": "ngram", "num_speculative_tokens": 4, '
     '"prompt_lookup_max": 4, "prompt_lookup_min": 2}\'; methods: ngram, radix, auto'),
    ("--kv-offload-dir", str, "kv_offload_dir", "local tier: KV evicted from the pool is kept "
     "as files here and loaded back instead of recomputed; survives restarts"),
    ("--kv-offload-size", float, "kv_offload_size", "bound of the local tier in GiB (default 16)"),
    ("--kv-shared-dir", str, "kv_shared_dir", "shared tier: a directory several replicas "
     "mount; computed KV blocks are published here and loaded by any replica"),
    ("--kv-offload-write-policy", str, "kv_offload_write_policy",
     f"when the local tier is written: {' | '.join(KV_OFFLOAD_WRITE_POLICIES)}"),
    ("--kv-offload-host-size", float, "kv_offload_host_size",
     "CUDA: GiB of pinned host memory above the local tier's disk (default 4)"),
    ("--kv-shared-size", float, "kv_shared_size",
     "this replica's bound on the shared tier in GiB (default 16); it deletes only its own "
     "model's blocks, never one any replica read in the last minute"),
    ("--kv-offload-shutdown-timeout", float, "kv_offload_shutdown_timeout",
     "seconds a clean shutdown waits for pending tier writes (default 30); the rest is logged"),
    ("--nnodes", int, "nnodes", "nodes the tensor-parallel ranks span (default 1)"),
    ("--node-rank", int, "node_rank", "this node's index; > 0: run only this node's "
     "tensor-parallel workers (no HTTP server)"),
    ("--dist-init-addr", str, "dist_init_addr", "HOST:PORT where the ranks meet (node 0's "
     "address; needed with --nnodes > 1)"),
]
_SERVER_FLAGS: list[tuple[str, Any, str, str]] = [
    ("--host", str, "host", "bind address"),
    ("--port", int, "port", "bind port"),
    ("--served-model-name", str, "served_model_name", "model name in the API (default: its own)"),
    ("--max-tokens-cap", int, "max_tokens_cap", "reject max_tokens above this; cap unset ones"),
    ("--max-input-tokens", int, "max_input_tokens", "reject longer prompts"),
    ("--max-concurrent-per-key", int, "max_concurrent_per_key", "429 past this per API key"),
    ("--max-queue", int, "max_queue", "429 (Retry-After) past this many queued requests, to "
     "the least important: a waiting one with a larger priority gives way"),
    ("--log-stats-interval", float, "log_stats_interval", "seconds between stats log lines"),
    ("--tool-call-parser", str, "tool_call_parser",
     f"how the model writes tool calls: {' | '.join(TOOL_CALL_PARSERS)}"),
    ("--reasoning-parser", str, "reasoning_parser", "split <think>...</think> into "
     f"message.reasoning_content: {' | '.join(REASONING_PARSERS)} (default: off)"),
    ("--api-keys-file", str, "api_keys_file", "JSON/TOML file of named keys with per-key limits "
     "(rpm, tpm, max_concurrency, max_tokens, max_input_tokens); SIGHUP reloads it"),
    ("--request-timeout", float, "request_timeout", "seconds a request may take; then 408"),
    ("--max-body-bytes", int, "max_body_bytes", "413 for larger request bodies"),
    ("--max-connections", int, "max_connections", "open client connections; past it: 503"),
    ("--keepalive-timeout", float, "keepalive_timeout",
     "close connections idle (or still sending headers) this long"),
    ("--body-timeout", float, "body_timeout", "408 when a request body takes longer to arrive"),
    ("--send-timeout", float, "send_timeout",
     "drop a client that accepts no response bytes for this long (streams and large answers)"),
    ("--shutdown-timeout", float, "shutdown_timeout",
     "SIGTERM: seconds in-flight requests get to finish"),
    ("--responses-store-size", int, "responses_store_size", "stored /v1/responses kept for "
     "previous_response_id and GET (least recently used dropped; 0: none; default 10000)"),
]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="radixserve", description="Prefix-sharing LLM server.")
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="start the OpenAI-compatible HTTP server")
    serve.add_argument("--model", default=None,
                       help="HF folder, .gguf file, or smollm2-135m (the default)")
    for flag, typ, field, text in _ENGINE_FLAGS + _SERVER_FLAGS:
        serve.add_argument(flag, type=typ, default=None, dest=field, help=text)
    serve.add_argument("--tensor-parallel-size", "-tp", "--tp-size", type=int, default=None,
                       dest="tensor_parallel_size",
                       help="split the model over N ranks (processes; one GPU each on CUDA)")
    serve.add_argument("--enable-expert-parallel", action="store_true", default=None,
                       dest="enable_expert_parallel",
                       help="MoE models: place num_experts / tensor_parallel_size whole "
                            "experts on each rank instead of slicing every expert")
    serve.add_argument("--api-key", action="append", default=None, dest="api_keys",
                       help=f"accepted Bearer key (repeatable; also ${API_KEY_ENV})")
    serve.add_argument("--enable-mixed-chunk", action=argparse.BooleanOptionalAction,
                       default=None, dest="mixed_chunk",
                       help="run prefill chunks in the same forward as running requests' "
                            "decode tokens (default: on)")
    serve.add_argument("--admin-key", default=None, dest="admin_key",
                       help="Bearer key for admin routes (/cache/pin, /cache/pins)")
    serve.add_argument("--max-pinned-tokens", type=int, default=None, dest="max_pinned_tokens",
                       help="most tokens pins may lock (default: a quarter of the KV pool)")
    serve.add_argument("--disable-radix-cache", action="store_true", default=None,
                       help="no prefix caching")
    serve.add_argument("--enforce-eager", action="store_true", default=None,
                       help="no CUDA graphs: every step runs eagerly")
    serve.add_argument("--disable-overlap-schedule", action="store_true", default=None,
                       help="plan each step after the last one's tokens are back (overlap "
                            "scheduling is on by default on CUDA)")
    serve.add_argument("--enable-kv-events", action="store_true", default=None,
                       help="publish cache block events on GET /kv_events")
    serve.add_argument("--shared-cache", action="store_true", default=None,
                       help="one prefix-cache namespace for all API keys (default: per key)")
    serve.add_argument("--log-requests", action="store_true", default=None,
                       help="log one line per request (prompt cut to a few characters)")
    serve.add_argument("--kv-events-config", default=None, metavar="JSON",
                       help='vLLM\'s KV-event config, e.g. \'{"enable_kv_cache_events": true, '
                            '"publisher": "zmq", "endpoint": "tcp://*:5557", '
                            '"replay_endpoint": "tcp://*:5558", "topic": "kv-events"}\': '
                            "block events in vLLM's msgpack format over ZMQ (also turns on "
                            "--enable-kv-events)")
    serve.add_argument("--prefix-caching-hash-algo", choices=["xxh64", "sha256_cbor"],
                       default=None, help="block hashes of the KV events (SSE and ZMQ): "
                       "xxh64 (default) or vLLM's sha256_cbor, which indexers recompute "
                       "from prompts")
    serve.add_argument("--metrics-compat", choices=METRICS_COMPAT, default=None,
                       help="vllm: /metrics also carries vllm:num_requests_waiting, "
                            "vllm:num_requests_running and vllm:kv_cache_usage_perc")
    serve.add_argument("--structured-outputs-allow-additional-properties", action="store_true",
                       default=None, dest="structured_outputs_allow_additional_properties",
                       help="let JSON schemas' objects generate properties they do not name "
                            "(JSON Schema's default); off: only named ones unless the schema "
                            "asks for more (vLLM's default)")
    serve.add_argument("--restart-engine", action="store_true", default=None,
                       help="restart a dead engine process (with backoff) instead of exiting 1")
    _add_lora_flags(serve)
    return parser


def _add_lora_flags(serve: argparse.ArgumentParser) -> None:
    serve.add_argument("--enable-lora", action="store_true", default=False,
                       help="serve LoRA adapters: a request names one in `model`")
    serve.add_argument("--lora-modules", nargs="+", default=None, metavar="NAME=PATH",
                       help='adapters (PEFT folders): name=path, or JSON {"name": ..., '
                            '"path": ..., "base_model_name": ...}')
    serve.add_argument("--max-loras", type=int, default=None,
                       help="distinct adapters in one batch (default 1)")
    serve.add_argument("--max-lora-rank", type=int, default=None,
                       help="highest adapter rank accepted (default 16)")
    serve.add_argument("--max-cpu-loras", type=int, default=None,
                       help="adapters kept loaded, least recently used dropped (default: "
                            "--max-loras)")


def _lora_config(args: argparse.Namespace, environ: dict[str, str]) -> LoRAConfig | None:
    """--enable-lora and its flags; the runtime routes as vLLM enables them (environment)."""
    given = {k: getattr(args, k) for k in ("max_loras", "max_lora_rank", "max_cpu_loras")
             if getattr(args, k) is not None}
    if not args.enable_lora:
        if given or args.lora_modules:
            raise ConfigError("--lora-modules / --max-loras / --max-lora-rank / "
                              "--max-cpu-loras need --enable-lora")
        return None
    runtime = environ.get(RUNTIME_LORA_ENV, "").strip().lower() in ("1", "true")
    modules = tuple(LoRAModule.parse(m) for m in args.lora_modules or ())
    return LoRAConfig(modules=modules, allow_runtime_updates=runtime, **given)


def parse_kv_events_config(text: str) -> KVEventsConfig:
    """`--kv-events-config` JSON -> KVEventsConfig; raises ConfigError naming the problem."""
    return kv_events_config_from(text, "--kv-events-config")


def build_config(args: argparse.Namespace, environ: dict[str, str]) -> ServerConfig:
    """Raises ConfigError for invalid settings."""
    def given(names: list[str]) -> dict[str, Any]:
        return {n: getattr(args, n) for n in names if getattr(args, n) is not None}

    engine_names = [f for _, _, f, _ in _ENGINE_FLAGS] + [
        "tensor_parallel_size", "enable_expert_parallel", "disable_radix_cache",
        "enable_kv_events", "max_pinned_tokens", "mixed_chunk",
        "structured_outputs_allow_additional_properties", "enforce_eager",
        "disable_overlap_schedule"]
    engine_kwargs = given(engine_names)
    engine_kwargs["lora"] = _lora_config(args, environ)
    kv_zmq = None
    if args.kv_events_config is not None:
        kv_zmq = parse_kv_events_config(args.kv_events_config)
        if kv_zmq.publishes:
            engine_kwargs["enable_kv_events"] = True
    if args.model is not None:
        engine_kwargs["model"] = args.model
    keys = list(args.api_keys or [])
    if environ.get(API_KEY_ENV):
        keys.append(environ[API_KEY_ENV])
    server_kwargs = given([f for _, _, f, _ in _SERVER_FLAGS]
                          + ["shared_cache", "admin_key", "log_requests", "restart_engine",
                             "metrics_compat", "prefix_caching_hash_algo"])
    if kv_zmq is not None:
        server_kwargs["kv_events_config"] = kv_zmq
    return ServerConfig(api_keys=tuple(dict.fromkeys(keys)), engine=EngineConfig(**engine_kwargs),
                        **server_kwargs)


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        cfg = build_config(args, dict(os.environ))
    except ConfigError as err:
        print(f"radixserve: error: {err}", file=sys.stderr)
        return 2
    if cfg.api_keys_file is not None:
        from radixserve.api.api_keys import load_keys_file

        try:
            load_keys_file(cfg.api_keys_file)  # fail fast, before anything starts
        except ConfigError as err:
            print(f"radixserve: error: {err}", file=sys.stderr)
            return 2
    if cfg.engine.node_rank > 0:  # another node of a multi-node model: its workers only
        from radixserve.engine.tp_ranks import run_node

        return run_node(cfg.engine)
    from radixserve.server.serve import run_server

    return run_server(cfg)
