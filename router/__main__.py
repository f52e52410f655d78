"""`radixserve-router` / `python -m router`: command line -> RouterConfig -> the aiohttp app.

Owns: argparse and the process entry point. Does not know: anything the app does.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Sequence
from typing import Any

from aiohttp import web

from radixserve.config.kv_events_config import HashAlgo
from router.config import ConfigError, PolicyName, RouterConfig
from router.discovery.discovery_config import add_discovery_args, discovery_from_args
from router.fleet.canary import parse_worker_flags

log = logging.getLogger("router")
ADMIN_KEY_ENV = "RADIXSERVE_ROUTER_ADMIN_KEY"
REPLICA_KEY_ENV = "RADIXSERVE_REPLICA_API_KEY"


class _InOrder(argparse.Action):
    """--worker and --weight into one list of (flag, value) in command-line order: a
    --weight applies to the --worker before it (canary.parse_worker_flags)."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace,
                 values: Any, option_string: str | None = None) -> None:
        flag = "--worker" if option_string == "--worker" else "--weight"
        setattr(namespace, self.dest, [*(getattr(namespace, self.dest) or []), (flag, values)])


def build_parser() -> argparse.ArgumentParser:
    d = RouterConfig()
    p = argparse.ArgumentParser(prog="radixserve-router",
                                description="Prefix-aware router in front of radixserve replicas.")
    p.add_argument("--worker", action=_InOrder, dest="worker_flags", metavar="URL",
                   help="a replica, e.g. http://127.0.0.1:30001 (repeatable); "
                   "URL@GROUP:PERCENT puts it in a canary group with that share of sessions")
    p.add_argument("--weight", action=_InOrder, dest="worker_flags", metavar="SHARE",
                   help="after a --worker: its group's share of sessions in [0, 1] (a worker "
                   "without @GROUP goes to the 'canary' group)")
    p.add_argument("--host", default=d.host)
    p.add_argument("--port", type=int, default=d.port)
    p.add_argument("--policy", choices=[x.value for x in PolicyName], default=d.policy.value)
    p.add_argument("--admin-key", default=os.environ.get(ADMIN_KEY_ENV) or None,
                   help=f"needed by /workers and /flush_cache (also ${ADMIN_KEY_ENV}); "
                        "without it, adding/removing workers and flushing are off")
    p.add_argument("--replica-api-key", default=os.environ.get(REPLICA_KEY_ENV) or None,
                   help="the replicas' API key, for /kv_events and /flush_cache "
                        f"(also ${REPLICA_KEY_ENV})")
    p.add_argument("--precise-max-blocks", type=int, default=d.precise_max_blocks,
                   help="block hashes kept per replica in precise mode")
    p.add_argument("--kv-events", action="store_true",
                   help="precise mode: follow each replica's /kv_events (cache_aware only)")
    p.add_argument("--tokenizer", default=None, metavar="MODEL",
                   help="model spec whose tokenizer the replicas use (precise mode)")
    p.add_argument("--kv-block-size", type=int, default=d.kv_block_size)
    p.add_argument("--prefix-caching-hash-algo", choices=[a.value for a in HashAlgo],
                   default=d.prefix_caching_hash_algo.value,
                   help="the replicas' block hash (their --prefix-caching-hash-algo), for "
                   "precise mode")
    p.add_argument("--shared-cache", action="store_true",
                   help="replicas share one cache namespace (their --shared-cache)")
    p.add_argument("--block-chars", type=int, default=d.block_chars)
    p.add_argument("--index-max-entries", type=int, default=d.index_max_entries)
    p.add_argument("--balance-lambda", type=float, default=d.balance_lambda)
    p.add_argument("--balance-abs-threshold", type=int, default=d.balance_abs_threshold,
                   help="loads differing by at most this many requests count as equal "
                   "(cache_aware): several routers, each seeing only its own load, then agree")
    p.add_argument("--health-interval", type=float, default=d.health_interval_s)
    p.add_argument("--health-timeout", type=float, default=d.health_timeout_s)
    p.add_argument("--fail-threshold", type=int, default=d.fail_threshold)
    p.add_argument("--success-threshold", type=int, default=d.success_threshold)
    p.add_argument("--max-retries", type=int, default=d.max_retries)
    p.add_argument("--connect-timeout", type=float, default=d.connect_timeout_s)
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--session-load-factor", type=float, default=d.session_load_factor,
                   help="a session stays on its replica while that one's load is below "
                   "ceil(FACTOR * (in flight + 1) / replicas); beyond, it spills over")
    p.add_argument("--max-resumes", type=int, default=d.max_resumes,
                   help="times a stream broken mid-way is continued on another replica "
                   "(0: it ends with an SSE error event)")
    p.add_argument("--stream-stall-timeout", type=float, default=d.stream_stall_timeout_s,
                   help="seconds without a byte after a stream started: the replica failed")
    p.add_argument("--request-timeout", type=float, default=d.request_timeout_s,
                   help="seconds for a whole non-streamed answer; past it: 504")
    p.add_argument("--first-byte-timeout", type=float, default=d.first_byte_timeout_s,
                   help="seconds for a replica's response headers and first byte (every "
                   "route, and a resumed stream); past it: 504, or an SSE error mid-stream")
    p.add_argument("--api-keys-file", default=None,
                   help="the replicas' keys file (.json/.toml): enforce each key's rpm, tpm "
                   "and max_concurrency fleet-wide before routing; reloaded on SIGHUP")
    p.add_argument("--router-replicas", type=int, default=d.router_replicas,
                   help="routers sharing the replicas: each enforces 1/N of every key "
                   "limit and breaks routing ties by hash, so routers agree")
    p.add_argument("--redis-url", default=None, metavar="redis://HOST:PORT/DB",
                   help="count every key's limits in this Redis, shared by all routers "
                   "(exact fleet-wide); while it is down each router enforces its "
                   "--router-replicas share")
    p.add_argument("--log-level", default="INFO")
    add_discovery_args(p)
    return p


def config_from_args(args: argparse.Namespace) -> RouterConfig:
    """Raises ConfigError for any invalid setting."""
    setup = parse_worker_flags(args.worker_flags or ())
    return RouterConfig(
        workers=setup.workers, worker_groups=setup.worker_groups,
        group_weights=setup.group_weights,
        host=args.host, port=args.port, policy=PolicyName(args.policy),
        admin_key=args.admin_key, replica_api_key=args.replica_api_key,
        precise_max_blocks=args.precise_max_blocks, kv_events=args.kv_events,
        tokenizer=args.tokenizer,
        kv_block_size=args.kv_block_size,
        prefix_caching_hash_algo=HashAlgo(args.prefix_caching_hash_algo), salt_by_api_key=not args.shared_cache,
        block_chars=args.block_chars, index_max_entries=args.index_max_entries,
        balance_lambda=args.balance_lambda, balance_abs_threshold=args.balance_abs_threshold,
        health_interval_s=args.health_interval,
        health_timeout_s=args.health_timeout, fail_threshold=args.fail_threshold,
        success_threshold=args.success_threshold, max_retries=args.max_retries,
        connect_timeout_s=args.connect_timeout, seed=args.seed,
        session_load_factor=args.session_load_factor, max_resumes=args.max_resumes,
        stream_stall_timeout_s=args.stream_stall_timeout,
        request_timeout_s=args.request_timeout, first_byte_timeout_s=args.first_byte_timeout, api_keys_file=args.api_keys_file,
        router_replicas=args.router_replicas, redis_url=args.redis_url,
    )


def main(argv: Sequence[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        cfg = config_from_args(args)
        discovery = discovery_from_args(args)
    except ConfigError as e:
        sys.exit(f"radixserve-router: {e}")
    if cfg.kv_events and cfg.tokenizer is None:
        log.warning("--kv-events without --tokenizer: only token-id prompts are scored "
                    "precisely; text and chat prompts use the approximate index")
    if not cfg.workers and discovery is None:
        log.warning("no --worker given: add some with POST /workers")
    from router.app import create_app  # after validation: a bad flag fails fast

    log.info("routing %d worker(s) with %s%s on http://%s:%d", len(cfg.workers),
             cfg.policy.value, " + kv events" if cfg.kv_events else "", cfg.host, cfg.port)
    if cfg.group_weights:
        log.info("canary groups (share of sessions): %s; the rest to stable",
                 ", ".join(f"{g} {w:.2%}" for g, w in cfg.group_weights))
    if discovery is not None:
        log.info("discovering workers by %s", discovery.mode.value)
    try:
        app = create_app(cfg, discovery=discovery)
    except ValueError as e:  # radixserve's ConfigError: a bad --api-keys-file
        sys.exit(f"radixserve-router: {e}")
    web.run_app(app, host=cfg.host, port=cfg.port, handler_cancellation=True,
                print=None)


if __name__ == "__main__":
    main()
