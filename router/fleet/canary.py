"""Canary groups: which share of sessions each group of workers gets, sticky per session.

Owns: the `--worker URL@GROUP:PERCENT` / `--worker URL --weight SHARE` flag grammar, the
session key of a request, its point in [0, 1), and TrafficSplit: the live group of every
worker, each group's share, and per-group counters. Does not know: HTTP, policies, health
(the caller passes routable workers), how replicas are chosen inside a group (routing.py).

Assignment. A request's session key is, first found: the `X-Session-Id` header, the body's
OpenAI `user` field, the Bearer API key, else the prompt's first block (text: its first
`block_chars` UTF-8 bytes; token ids: the first `kv_block_size` ids; chat: the messages up
to and including the first user message), so later turns of a conversation keep the key.
The key hashes (blake2b, fixed, so stable across restarts and processes) to a point in
[0, 1). Named groups, sorted by name, take consecutive intervals of their shares from 0;
the stable group takes the rest. No per-session state: raising one group's share from a to
b moves only the sessions in [a, b). A session whose group has no routable worker goes to
the other groups' workers (a fallback, counted against the group it was assigned to).
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import orjson

from router.config import (
    STABLE_GROUP,
    ConfigError,
    check_group_name,
    check_share,
    check_total_share,
    normalize_worker_url,
)
from router.routing.route_key import Prompt, canonical_chat
from router.workers import Worker

SESSION_HEADER = "X-Session-Id"
DEFAULT_CANARY_GROUP = "canary"  # the group of a `--worker URL --weight SHARE`
_POINT_BITS = 53  # a double holds 53 bits exactly: the point is < 1.0, never rounded up


class WorkerSetup(NamedTuple):
    """What the --worker / --weight flags say, in RouterConfig's terms."""

    workers: tuple[str, ...]
    worker_groups: tuple[tuple[str, str], ...]
    group_weights: tuple[tuple[str, float], ...]


def _split_spec(spec: str) -> tuple[str, str | None, float | None]:
    """`URL[@GROUP[:PERCENT]]` -> (normalized url, group, share); worker URLs carry no userinfo,
    so an '@' always starts the group."""
    url, at, tail = spec.partition("@")
    if not at:
        return normalize_worker_url(url), None, None
    group, colon, percent = tail.partition(":")
    check_group_name(group, "--worker URL@GROUP")
    if not colon:
        return normalize_worker_url(url), group, None
    try:
        value = float(percent)
    except ValueError:
        value = math.nan
    if not math.isfinite(value) or not 0.0 <= value <= 100.0:
        raise ConfigError(f"--worker URL@GROUP:PERCENT: percent must be a number in "
                          f"[0, 100], got {percent!r} in {spec!r}")
    return normalize_worker_url(url), group, value / 100.0


def parse_worker_flags(flags: Iterable[tuple[str, str]]) -> WorkerSetup:
    """`flags` in command-line order: ("--worker", spec) or ("--weight", share); a --weight
    applies to the --worker just before it. Raises ConfigError naming the flag."""
    entries: list[list[Any]] = []  # [url, group | None, share | None]
    for flag, value in flags:
        if flag == "--worker":
            entries.append(list(_split_spec(value)))
            continue
        assert flag == "--weight", flag
        if not entries:
            raise ConfigError("--weight must follow the --worker it applies to")
        if entries[-1][2] is not None:
            raise ConfigError(f"--weight: worker {entries[-1][0]} already has a share")
        try:
            given: object = float(value)
        except ValueError:
            given = value
        entries[-1][2] = check_share(given, "--weight")
    groups: list[tuple[str, str]] = []
    weights: dict[str, float] = {}
    for url, group, share in entries:
        group = group or (DEFAULT_CANARY_GROUP if share is not None else STABLE_GROUP)
        if group == STABLE_GROUP:
            if share is not None:
                raise ConfigError(f"--weight: {url} is in the {STABLE_GROUP!r} group, which "
                                  "takes the share the other groups leave")
            continue
        groups.append((url, group))
        if share is not None and weights.setdefault(group, share) != share:
            raise ConfigError(f"--weight: group {group!r} given two shares, {weights[group]:g} "
                              f"and {share:g} (a share is the whole group's)")
    return WorkerSetup(tuple(e[0] for e in entries), tuple(groups), tuple(weights.items()))


def _bearer_token(authorization: str | None) -> str | None:
    scheme, _, token = (authorization or "").partition(" ")
    return (token.strip() or None) if scheme.lower() == "bearer" else None


def _prompt_head(prompt: Prompt, block_chars: int, kv_block_size: int) -> bytes | None:
    if prompt.text is not None:
        return prompt.text.encode("utf-8")[:block_chars]
    if prompt.token_ids is not None:
        return orjson.dumps(prompt.token_ids[:kv_block_size])
    if prompt.messages is not None:
        users = [i for i, m in enumerate(prompt.messages) if m.get("role") == "user"]
        end = users[0] + 1 if users else len(prompt.messages)
        return canonical_chat(prompt.messages[:end])
    return None


def session_key(session_id: str | None, body: Any, authorization: str | None, prompt: Prompt,
                block_chars: int, kv_block_size: int) -> bytes | None:
    """The bytes a request's session is known by (module docstring); None if it has none."""
    if session_id and session_id.strip():
        return session_id.strip().encode("utf-8")
    user = body.get("user") if isinstance(body, dict) else None
    if isinstance(user, str) and user:
        return user.encode("utf-8")
    token = _bearer_token(authorization)
    if token is not None:
        return token.encode("utf-8")
    return _prompt_head(prompt, block_chars, kv_block_size)


def split_point(key: bytes) -> float:
    """A fixed hash of `key` to [0, 1), uniform enough that shares hold to a point or two."""
    digest = hashlib.blake2b(key, digest_size=8, person=b"radixserve-split").digest()
    return (int.from_bytes(digest, "big") >> (64 - _POINT_BITS)) / float(1 << _POINT_BITS)


class SplitUpdateError(ValueError):
    """An admin change the split refuses; `param` names the field at fault."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


@dataclass
class GroupStats:
    routed: int = 0  # requests sent to a worker of the group (each retry counts)
    fallbacks: int = 0  # requests assigned to the group but sent to another (none routable)
    errors_before: int = 0  # worker errors of workers that have since left the group


@dataclass
class _Member:
    group: str
    errors_at_join: int  # the worker's num_errors when it joined `group`


class GroupView(NamedTuple):
    name: str
    share: float
    workers: list[str]
    routed: int
    errors: int
    fallbacks: int


class TrafficSplit:
    """Groups, shares and per-group counters. Owned by the Router (`router.split`): routing
    reads it in choose() and counts in record(); admin handlers change it with update()."""

    def __init__(self, workers: Sequence[str], worker_groups: Sequence[tuple[str, str]],
                 group_weights: Sequence[tuple[str, float]]) -> None:
        grouped = dict(worker_groups)
        self._members = {u: _Member(grouped.get(u, STABLE_GROUP), 0) for u in workers}
        self._shares: dict[str, float] = dict(group_weights)  # named groups only
        self._stats: dict[str, GroupStats] = {STABLE_GROUP: GroupStats()}
        for group in self._shares:
            self._stats[group] = GroupStats()

    @property
    def active(self) -> bool:
        """Whether any named group exists (else every request may go anywhere)."""
        return bool(self._shares)

    def group_of(self, url: str) -> str:
        member = self._members.get(url)
        return member.group if member is not None else STABLE_GROUP

    def shares(self) -> dict[str, float]:
        """Every group's share of sessions, named groups by name, then stable."""
        named = {g: self._shares[g] for g in sorted(self._shares)}
        # Rounded: 0.7 + 0.2 + 0.1 leaves 1e-16, not a share anyone configured.
        return {**named, STABLE_GROUP: max(0.0, round(1.0 - sum(named.values()), 12))}

    def group_at(self, point: float) -> str:
        edge = 0.0
        for group in sorted(self._shares):
            edge += self._shares[group]
            if point < edge:
                return group
        return STABLE_GROUP

    def narrow(self, workers: list[Worker], point: float | None) -> list[Worker]:
        """The routable workers of the group `point` falls in; all of them if it has none."""
        if point is None or not self._shares:
            return workers
        group = self.group_at(point)
        members = [w for w in workers if self.group_of(w.url) == group]
        return members or workers

    def note_routed(self, point: float | None, worker: Worker) -> None:
        served = self.group_of(worker.url)
        self._stats[served].routed += 1
        if point is not None and self._shares:
            assigned = self.group_at(point)
            if assigned != served:
                self._stats[assigned].fallbacks += 1

    # --- membership and shares (admin) ---------------------------------------------------

    def add(self, worker: Worker) -> None:
        """A new worker joins the stable group; `update` moves it."""
        self._members[worker.url] = _Member(STABLE_GROUP, worker.num_errors)

    def remove(self, worker: Worker) -> None:
        member = self._members.pop(worker.url)
        self._stats[member.group].errors_before += worker.num_errors - member.errors_at_join

    def update(self, worker: Worker | None, group: str | None, share: object) -> None:
        """Move `worker` to `group` and/or set `group`'s share (None: unchanged); checks all
        first, so a refused change changes nothing. Raises SplitUpdateError."""
        if group is None:
            if worker is None:
                raise SplitUpdateError("give the group (or a worker url) to change", "group")
            group = self.group_of(worker.url)
        try:
            check_group_name(group, "group")
        except ConfigError as e:
            raise SplitUpdateError(str(e), "group") from None
        try:
            new_share = None if share is None else check_share(share, "weight")
        except ConfigError as e:
            raise SplitUpdateError(str(e), "weight") from None
        if group == STABLE_GROUP and new_share is not None:
            raise SplitUpdateError(f"the {STABLE_GROUP!r} group takes the share the other "
                                   "groups leave; it has no weight of its own", "weight")
        if worker is None and group not in self._shares and group != STABLE_GROUP:
            raise SplitUpdateError(f"group {group!r} does not exist; give a worker url to "
                                   "move into it", "group")
        shares = dict(self._shares)
        if new_share is not None:
            shares[group] = new_share
        if group != STABLE_GROUP and group not in shares:
            raise SplitUpdateError(f"group {group!r} is new: give its weight", "weight")
        try:
            check_total_share(shares, "weight")
        except ConfigError as e:
            raise SplitUpdateError(str(e), "weight") from None
        self._shares = shares
        self._stats.setdefault(group, GroupStats())
        if worker is not None:
            self._move(worker, group)

    def _move(self, worker: Worker, group: str) -> None:
        member = self._members[worker.url]
        if member.group != group:
            self.remove(worker)
            self._members[worker.url] = _Member(group, worker.num_errors)

    # --- reading ---------------------------------------------------------------------------

    def views(self, workers: Sequence[Worker]) -> list[GroupView]:
        """Each group with its workers among `workers` and its counters; errors include those
        of workers that have since left the group."""
        out = []
        for name, share in self.shares().items():
            members = [w for w in workers if self.group_of(w.url) == name]
            stats = self._stats[name]
            errors = stats.errors_before + sum(
                w.num_errors - self._members[w.url].errors_at_join for w in members)
            out.append(GroupView(name, share, [w.url for w in members], stats.routed, errors,
                                 stats.fallbacks))
        return out
