"""Router: from a request's key to a worker, through the policy and the fleet controls.

Owns: the worker pool, the policy, the approximate prefix index and (precise mode) the
per-replica KV-event state with one follower task per worker; adding and removing workers
at run time keeps all of them in step; the fleet controls a choice goes through (sessions,
canary split, key limits: fleet/) and the bookkeeping after it. It sits above routing/ and
fleet/ (fleet/ uses routing/'s types; neither imports this). Does not know: HTTP handlers,
request bodies (routing/route_key.py makes keys), how bytes are proxied (proxy/).
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any, NamedTuple

import aiohttp

from router.breaker import Breaker
from router.config import RouterConfig
from router.fleet.canary import TrafficSplit, session_key, split_point
from router.fleet.key_limits import FleetLimits
from router.fleet.redis_limits import RedisCounter
from router.fleet.response_owners import ResponseOwners
from router.fleet.sessions import SessionAffinity, SessionOutcome, session_id, stable_hash
from router.routing.kv_index import PreciseIndex, follow_kv_events
from router.routing.policy import Candidate, ChoiceReason, Policy, make_policy
from router.routing.prefix_index import ApproxPrefixIndex
from router.routing.route_key import (
    PromptEncoder,
    RequestKind,
    RouteKey,
    approx_hashes,
    encoding_chars,
    extract_prompt,
    model_of,
    route_salts,
    salt_for,
    token_chains,
)
from router.workers import Worker, WorkerPool

# Up to this many characters a prompt is tokenized on the loop: a fast BPE tokenizer takes
# about as long as handing the work to a thread costs on a busy host (figures:
# bench/README.md); longer prompts go to the default executor.
INLINE_ENCODE_CHARS = 2048


class Decision(NamedTuple):
    worker: Worker
    reason: ChoiceReason
    matched_blocks: int  # by the index that scored this worker (precise if live)
    total_blocks: int
    session: SessionOutcome | None = None  # how session affinity placed it (None: no session)


class Router:
    def __init__(self, cfg: RouterConfig, encoder: PromptEncoder | None = None) -> None:
        self.cfg = cfg
        self.pool = WorkerPool(cfg.workers, cfg.fail_threshold, cfg.success_threshold,
                               Breaker(cfg.breaker_cooldown_s, cfg.breaker_max_cooldown_s))
        self.sessions = SessionAffinity(cfg.max_sessions, cfg.session_load_factor)
        self.responses = ResponseOwners(cfg.max_sessions)  # response id -> its replica
        self.stream_counts: dict[str, int] = {"resumed": 0, "failed": 0}  # resume.py
        redis = (RedisCounter(cfg.redis_url, slot_ttl_s=2 * cfg.request_timeout_s)
                 if cfg.redis_url else None)
        self.limits = (FleetLimits(cfg.api_keys_file, cfg.router_replicas, redis=redis)
                       if cfg.api_keys_file else None)  # raises ConfigError for a bad file
        self.policy: Policy = make_policy(cfg)
        self.index = ApproxPrefixIndex(cfg.index_max_entries)
        self.precise = (PreciseIndex(cfg.kv_block_size, cfg.pending_ttl_s,
                                     max_blocks=cfg.precise_max_blocks)
                        if cfg.kv_events else None)
        self.encoder = encoder
        self.split = TrafficSplit(cfg.workers, cfg.worker_groups, cfg.group_weights)
        self._session: aiohttp.ClientSession | None = None
        self._followers: dict[str, asyncio.Task[None]] = {}
        if self.precise is not None:
            for url in cfg.workers:
                self.precise.add_worker(url)

    # --- keys and choices ----------------------------------------------------------------

    async def route_key(self, kind: RequestKind, body: Any, authorization: str | None,
                        session_header: str | None = None) -> RouteKey:
        """The prefix key, the session (cache_aware), (canary groups configured) the
        session's split point, and the replica a Responses chain is pinned to."""
        key = await self._prefix_key(kind, body, authorization)
        if kind is RequestKind.RESPONSES and isinstance(body, dict):
            prev = body.get("previous_response_id")
            if isinstance(prev, str) and prev:
                key = key._replace(pinned=await self._response_owner(prev, authorization))
        if self.policy.uses_prefix and not self.split.active:
            # With canary groups the split keeps a session in its group (canary.py); replica
            # affinity inside a group whose membership admins move would fight it.
            key = key._replace(session=session_id(session_header, body))
        if not self.split.active:
            return key
        skey = session_key(session_header, body, authorization, extract_prompt(kind, body),
                           self.cfg.block_chars, self.cfg.kv_block_size)
        return key._replace(split_point=None if skey is None else split_point(skey))

    async def _response_owner(self, response_id: str, authorization: str | None) -> str | None:
        """Known from the replicas' answers, else asked of them (a router restart)."""
        owner = self.responses.owner(response_id)
        if owner is None and self._session is not None:
            urls = [w.url for w in self.pool.routable()]
            owner = await self.responses.locate(self._session, response_id, urls,
                                                authorization)
        return owner

    async def _prefix_key(self, kind: RequestKind, body: Any, authorization: str | None
                          ) -> RouteKey:
        if not self.policy.uses_prefix:
            return RouteKey(())
        prompt = extract_prompt(kind, body)
        salt = salt_for(authorization, self.cfg.salt_by_api_key)
        # The adapter (`model`) is part of the key (see route_key's docstring)
        salts, approx_salt = route_salts(salt, model_of(body))
        approx = approx_hashes(prompt, approx_salt, self.cfg.block_chars,
                               self.cfg.kv_block_size)
        if self.precise is None:
            return RouteKey(tuple(approx))
        bs, algo = self.cfg.kv_block_size, self.cfg.prefix_caching_hash_algo
        if encoding_chars(prompt) > INLINE_ENCODE_CHARS:
            # A tokenizer run on a long prompt would stall every other request on the loop.
            loop = asyncio.get_running_loop()
            chains = await loop.run_in_executor(
                None, token_chains, prompt, salts, bs, self.encoder, algo
            )
        else:
            chains = token_chains(prompt, salts, bs, self.encoder, algo)
        return RouteKey(tuple(approx), tuple(chains))

    def _precise_match(self, key: RouteKey, url: str) -> float | None:
        if self.precise is None or not key.token_chains:
            return None
        matches = [self.precise.match(chain, url) for chain in key.token_chains]
        return None if matches[0] is None else max(m or 0 for m in matches)

    def choose(self, key: RouteKey, exclude: frozenset[str] = frozenset()) -> Decision | None:
        """The worker for `key` among routable ones not in `exclude`; None if there is none."""
        workers = self.split.narrow(self.pool.routable(exclude), key.split_point)
        if not workers:
            return None
        pinned = next((w for w in workers if w.url == key.pinned), None)
        if pinned is not None:  # elsewhere the chain would be a 404
            return Decision(pinned, ChoiceReason.RESPONSE, 0, 0)
        if not self.policy.uses_prefix:
            choice = self.policy.choose([Candidate(w.url, w.in_flight) for w in workers])
            chosen = next(w for w in workers if w.url == choice.url)
            return Decision(chosen, choice.reason, 0, 0)
        approx = self.index.match(key.approx_hashes, [w.url for w in workers])
        scored: dict[str, tuple[float, int]] = {}  # url -> (matched, total) blocks
        candidates = []
        for w in workers:
            exact = self._precise_match(key, w.url)
            if exact is not None:
                matched, total = exact, len(key.token_chains[0])
            else:
                matched, total = approx[w.url], len(key.approx_hashes)
            scored[w.url] = (matched, total)
            candidates.append(Candidate(w.url, w.in_flight, matched / total if total else 0.0))
        if key.session is not None:
            pick = self.sessions.pick(key.session, candidates)
            if pick is not None:
                chosen = next(w for w in workers if w.url == pick.url)
                matched, total = scored[chosen.url]
                return Decision(chosen, ChoiceReason.SESSION, int(matched), total, pick.outcome)
        choice = self.policy.choose(candidates, self._tie_key(key))
        chosen = next(w for w in workers if w.url == choice.url)
        outcome = None if key.session is None else \
            self.sessions.outcome_for_policy_choice(key.session)
        matched, total = scored[chosen.url]
        return Decision(chosen, choice.reason, int(matched), total, outcome)

    def _tie_key(self, key: RouteKey) -> int | None:
        """Several routers: ties broken by the prompt's first block (or session), the same
        in every router; one router: None (rotation, as ever)."""
        if self.cfg.router_replicas == 1:
            return None
        if key.session is not None:
            return stable_hash(key.session)
        first = key.token_chains[0][:1] if key.token_chains else key.approx_hashes[:1]
        return first[0] if first else None

    def record(self, key: RouteKey, decision: Decision) -> None:
        """The chosen worker now holds (or soon will) the request's blocks."""
        w = decision.worker
        w.num_routed += 1
        self.split.note_routed(key.split_point, w)
        w.prefix_query_blocks += decision.total_blocks
        w.prefix_hit_blocks += decision.matched_blocks
        if w.url not in self.pool:
            return  # removed meanwhile: its entries are gone and must stay gone
        if key.session is not None and decision.session is not None:
            self.sessions.note(key.session, w.url, decision.session)
        self.index.record(key.approx_hashes, w.url)
        if self.precise is not None and key.token_chains:
            # Only the configured namespace's chain: pending blocks under both would make a
            # salting replica look like it holds other keys' unsalted prefixes.
            self.precise.note_routed(key.token_chains[0], w.url)

    # --- workers at run time -------------------------------------------------------------

    def add_worker(self, url: str) -> Worker:
        """Raises WorkerExistsError. Starts following its KV events in precise mode."""
        worker = self.pool.add(url)
        self.split.add(worker)
        if self.precise is not None:
            self.precise.add_worker(url)
            self._follow(url)
        return worker

    async def remove_worker(self, url: str) -> Worker:
        """Raises UnknownWorkerError. Drops its index entries and stops its KV follower."""
        worker = self.pool.remove(url)
        self.split.remove(worker)
        self.index.drop_worker(url)
        self.sessions.forget_worker(url)
        self.responses.forget_worker(url)
        if self.precise is not None:
            self.precise.drop_worker(url)
        task = self._followers.pop(url, None)
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        return worker

    # --- lifecycle (the app's cleanup_ctx) -----------------------------------------------

    @property
    def session(self) -> aiohttp.ClientSession:
        assert self._session is not None, "Router.start() has not run (the app's cleanup_ctx)"
        return self._session

    def start(self, session: aiohttp.ClientSession) -> None:
        self._session = session
        if self.precise is not None:
            for w in self.pool.all():
                self._follow(w.url)

    async def stop(self) -> None:
        tasks = list(self._followers.values())
        self._followers.clear()
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._session = None
        if self.limits is not None and self.limits.redis is not None:
            await self.limits.redis.close()

    def _follow(self, url: str) -> None:
        if self._session is None or self.precise is None:
            return  # start() follows every worker once the session exists
        self._followers[url] = asyncio.create_task(
            follow_kv_events(self._session, url, self.precise, self.cfg.kv_stream_timeout_s,
                             self.cfg.replica_api_key),
            name=f"kv_events {url}",
        )
