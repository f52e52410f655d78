"""Router canary groups: flag forms and bad values, the session share over 2,000 sessions,
stickiness per session / user / key / conversation, live weight changes, fallback, and the
same over HTTP with fake replicas (admin call, /metrics)."""

from __future__ import annotations

from typing import Any

import aiohttp
import pytest

from radixserve.testing.fake_replica import FakeReplicaConfig, fake_cluster
from router.__main__ import build_parser, config_from_args, main
from router.config import ConfigError, PolicyName, RouterConfig
from router.core import Router
from router.fleet.canary import SESSION_HEADER, SplitUpdateError, session_key, split_point
from router.routing.route_key import Prompt, RequestKind, extract_prompt

pytestmark = pytest.mark.timeout(60)

S1, S2, C = "http://127.0.0.1:9001", "http://127.0.0.1:9002", "http://127.0.0.1:9003"


def parse(*argv: str) -> RouterConfig:
    return config_from_args(build_parser().parse_args(list(argv)))


# --- flags -------------------------------------------------------------------------------

def test_both_flag_forms_give_the_same_config() -> None:
    a = parse("--worker", S1, "--worker", S2, "--worker", C, "--weight", "0.05")
    b = parse("--worker", S1, "--worker", S2 + "/", "--worker", f"{C}@canary:5")
    for cfg in (a, b):
        assert cfg.workers == (S1, S2, C)
        assert cfg.worker_groups == ((C, "canary"),)
        assert cfg.group_weights == (("canary", 0.05),)
    # --weight applies to the --worker just before it, wherever it is.
    c = parse("--worker", C, "--weight", "0.1", "--worker", S1)
    assert c.worker_groups == ((C, "canary"),) and c.group_weights == (("canary", 0.1),)
    d = parse("--worker", f"{C}@beta", "--weight", "0.2", "--worker", f"{S2}@canary:5",
              "--worker", S1)
    assert dict(d.worker_groups) == {C: "beta", S2: "canary"}
    assert dict(d.group_weights) == {"beta": 0.2, "canary": 0.05}
    plain = parse("--worker", S1, "--worker", S2)
    assert plain.worker_groups == () and plain.group_weights == ()


@pytest.mark.parametrize(("argv", "flag", "words"), [
    (["--weight", "0.05", "--worker", C], "--weight", "must follow"),
    (["--worker", C, "--weight", "1.5"], "--weight", "[0, 1]"),
    (["--worker", C, "--weight", "-0.1"], "--weight", "[0, 1]"),
    (["--worker", C, "--weight", "abc"], "--weight", "[0, 1]"),
    (["--worker", C, "--weight", "nan"], "--weight", "[0, 1]"),
    (["--worker", C, "--weight", "0.1", "--weight", "0.2"], "--weight", "already has"),
    (["--worker", f"{C}@canary:5", "--weight", "0.05"], "--weight", "already has"),
    (["--worker", f"{C}@canary:150"], "--worker URL@GROUP:PERCENT", "[0, 100]"),
    (["--worker", f"{C}@canary:x"], "--worker URL@GROUP:PERCENT", "[0, 100]"),
    (["--worker", f"{C}@canary"], "--weight", "has no weight"),
    (["--worker", f"{C}@stable:5"], "--weight", "stable"),
    (["--worker", f"{C}@1bad:5"], "--worker URL@GROUP", "group name"),
    (["--worker", f"{C}@:5"], "--worker URL@GROUP", "group name"),
    (["--worker", S1, "--weight", "0.6", "--worker", C, "--weight", "0.5"], "--weight",
     "two shares"),
    (["--worker", f"{S1}@a:60", "--worker", f"{C}@b:50"], "--weight", "add up to 1.1"),
    (["--worker", "nope@canary:5"], "worker URL", "http://host:port"),
])
def test_bad_canary_flags_name_the_flag(argv: list[str], flag: str, words: str) -> None:
    with pytest.raises(ConfigError) as err:
        parse(*argv)
    assert flag in str(err.value) and words in str(err.value)


def test_bad_flags_stop_the_cli_and_the_config_checks_its_own_fields() -> None:
    with pytest.raises(SystemExit) as err:
        main(["--worker", C, "--weight", "2"])
    assert "--weight must be a number in [0, 1], got 2.0" in str(err.value.code)
    with pytest.raises(ConfigError, match="has a group but is not a worker"):
        RouterConfig(workers=(S1,), worker_groups=((C, "canary"),),
                     group_weights=(("canary", 0.1),))
    with pytest.raises(ConfigError, match="has a weight but no worker"):
        RouterConfig(workers=(S1, C), worker_groups=((C, "canary"),),
                     group_weights=(("canary", 0.1), ("beta", 0.1)))
    assert parse("--worker", S1, "--worker", f"{C}@canary:100").group_weights == (
        ("canary", 1.0),)


# --- the split at the Router level ------------------------------------------------------

def canary_router(share: float = 0.05, policy: PolicyName = PolicyName.CACHE_AWARE) -> Router:
    return Router(RouterConfig(workers=(S1, S2, C), worker_groups=((C, "canary"),),
                               group_weights=(("canary", share),), policy=policy))


async def route(router: Router, body: dict[str, Any], session: str | None = None,
                auth: str | None = None, kind: RequestKind = RequestKind.COMPLETIONS) -> str:
    key = await router.route_key(kind, body, auth, session)
    decision = router.choose(key)
    assert decision is not None
    router.record(key, decision)
    return decision.worker.url


async def canary_sessions(router: Router, n: int) -> set[int]:
    return {i for i in range(n)
            if await route(router, {"prompt": "same prompt " * 8}, f"session-{i}") == C}


async def test_canary_share_over_2000_sessions_is_within_2_points() -> None:
    router = canary_router(0.05)
    canary = await canary_sessions(router, 2000)
    assert 60 <= len(canary) <= 140  # 5% +- 2 points of 2,000
    assert len(canary) == 92  # the hash is fixed: the same sessions on every router
    views = {v.name: v for v in router.split.views(router.pool.all())}
    assert (views["canary"].routed, views["stable"].routed) == (92, 1908)
    assert views["canary"].share == 0.05 and views["stable"].share == pytest.approx(0.95)
    assert await canary_sessions(canary_router(0.05, PolicyName.ROUND_ROBIN), 2000) == canary


async def test_a_session_stays_in_its_group() -> None:
    router = canary_router(0.5)
    for i in range(40):  # 40 sessions x 10 requests with unrelated prompts
        urls = {await route(router, {"prompt": f"turn {t} of {i}"}, f"s{i}") for t in range(10)}
        assert urls <= {C} or C not in urls
    for i in range(20):  # the OpenAI `user` field, then the API key
        by_user = {await route(router, {"prompt": f"q{t}", "user": f"u{i}"}) for t in range(5)}
        by_key = {await route(router, {"prompt": f"q{t}"}, auth=f"Bearer k{i}")
                  for t in range(5)}
        assert len(by_user & {C}) == 0 or by_user == {C}
        assert len(by_key & {C}) == 0 or by_key == {C}


async def test_a_conversation_without_ids_sticks_by_its_first_messages() -> None:
    router = canary_router(0.5, PolicyName.ROUND_ROBIN)  # no prefix affinity to help
    in_canary = 0
    for i in range(60):
        messages = [{"role": "system", "content": "You are terse."},
                    {"role": "user", "content": f"conversation {i} starts here"}]
        groups = set()
        for turn in range(5):
            url = await route(router, {"messages": messages}, kind=RequestKind.CHAT)
            groups.add(url == C)
            messages = [*messages, {"role": "assistant", "content": f"answer {turn}"},
                        {"role": "user", "content": f"follow-up {turn}"}]
        assert len(groups) == 1
        in_canary += groups == {True}
    assert 0 < in_canary < 60  # conversations spread over both groups
    # Text prompts: the first block (64 bytes) is the key; later turns extend it.
    first = "A" * 30 + "the first turn of a text conversation, long enough"
    url = await route(router, {"prompt": first})
    assert all([await route(router, {"prompt": first + f" turn {t}" * t}) == url
                for t in range(1, 6)])


def test_session_key_order() -> None:
    prompt = Prompt(text="p" * 100)
    body = {"user": "the-user", "prompt": "p" * 100}
    assert session_key("hdr", body, "Bearer k", prompt, 64, 16) == b"hdr"
    assert session_key(None, body, "Bearer k", prompt, 64, 16) == b"the-user"
    assert session_key(" ", {"prompt": "x"}, "Bearer k", prompt, 64, 16) == b"k"
    assert session_key(None, {}, "Basic zzz", prompt, 64, 16) == b"p" * 64
    ids = extract_prompt(RequestKind.GENERATE, {"input_ids": list(range(40))})
    assert session_key(None, {}, None, ids, 64, 16) == b"[0,1,2,3,4,5,6,7,8,9,10,11,12,13,14,15]"
    assert session_key(None, {}, None, Prompt(), 64, 16) is None
    assert 0.0 <= split_point(b"") < 1.0 and split_point(b"x") == split_point(b"x")


async def test_a_live_weight_change_moves_only_the_boundary_sessions() -> None:
    router = canary_router(0.05)
    at_5 = await canary_sessions(router, 2000)
    c = router.pool.get(C)
    assert c is not None
    router.split.update(None, "canary", 0.20)
    at_20 = await canary_sessions(router, 2000)
    assert at_5 < at_20 and 360 <= len(at_20) <= 440  # 20% +- 2 points
    router.split.update(None, "canary", 0.0)  # drain: new requests leave the canary
    assert await canary_sessions(router, 2000) == set()
    router.split.update(c, "stable", None)  # back to stable: plain routing over 3 workers
    assert router.split.group_of(C) == "stable"
    urls = [await route(router, {"prompt": f"distinct {i} " * 10}, f"session-{i}")
            for i in range(30)]
    assert urls.count(C) == 10  # misses rotate over the three


async def test_a_group_with_no_routable_worker_falls_back_and_counts_it() -> None:
    router = canary_router(0.5, PolicyName.ROUND_ROBIN)
    c = router.pool.get(C)
    assert c is not None
    c.healthy = False
    urls = [await route(router, {"prompt": "x"}, f"s{i}") for i in range(200)]
    assert C not in urls
    views = {v.name: v for v in router.split.views(router.pool.all())}
    assigned = sum(router.split.group_at(split_point(f"s{i}".encode())) == "canary"
                   for i in range(200))
    assert 0 < assigned < 200
    assert views["canary"].fallbacks == assigned and views["stable"].routed == 200
    c.healthy = True
    back = next(i for i in range(200)
                if router.split.group_at(split_point(f"s{i}".encode())) == "canary")
    assert await route(router, {"prompt": "x"}, f"s{back}") == C


def test_split_updates_check_everything_first_and_keep_error_counts() -> None:
    router = canary_router(0.1)
    split, s1, c = router.split, router.pool.get(S1), router.pool.get(C)
    assert s1 is not None and c is not None
    for worker, group, share, param in ((s1, "beta", None, "weight"),  # new group, no share
                                        (s1, "beta", 0.95, "weight"),  # 0.1 + 0.95 > 1
                                        (None, "beta", 0.1, "group"),  # no such group
                                        (None, None, 0.1, "group"),
                                        (s1, "bad name", 0.1, "group"),
                                        (s1, None, 0.1, "weight"),  # s1 is stable
                                        (c, None, True, "weight")):
        with pytest.raises(SplitUpdateError) as err:
            split.update(worker, group, share)
        assert err.value.param == param
    assert split.shares() == {"canary": 0.1, "stable": 0.9}
    assert split.group_of(S1) == "stable"
    split.update(s1, "beta", 0.2)
    split.update(None, "canary", 0.7)
    assert split.shares() == {"beta": 0.2, "canary": 0.7, "stable": 0.1}
    assert [split.group_at(p) for p in (0.0, 0.19, 0.2, 0.89, 0.9, 0.999)] == [
        "beta", "beta", "canary", "canary", "stable", "stable"]
    c.num_errors = 3  # as the proxy counts them
    split.update(c, "stable", None)  # the canary keeps the errors made while in it
    c.num_errors = 5
    views = {v.name: v for v in split.views(router.pool.all())}
    assert (views["canary"].errors, views["stable"].errors) == (3, 2)
    assert views["canary"].workers == [] and views["stable"].workers == [S2, C]


# --- over HTTP ---------------------------------------------------------------------------

ADMIN = {"Authorization": "Bearer admin-secret"}
CFG = RouterConfig(health_interval_s=0.05, health_timeout_s=1.0, admin_key="admin-secret",
                   retry_backoff_s=0.01, fail_threshold=100)


async def served(s: aiohttp.ClientSession, url: str, session: str) -> str:
    async with s.post(f"{url}/v1/completions", json={"prompt": "hello " * 20, "max_tokens": 2},
                      headers={SESSION_HEADER: session}) as resp:
        assert resp.status == 200, await resp.text()
        return resp.headers["X-Fake-Replica"]


def metric(text: str, name: str, group: str) -> float:
    prefix = f'radixserve_router:{name}{{group="{group}"}} '
    return float(next(ln for ln in text.splitlines() if ln.startswith(prefix)).split()[-1])


async def test_canary_over_http_with_a_live_weight_change() -> None:
    replicas = [FakeReplicaConfig(name="stable"), FakeReplicaConfig(name="canary")]
    async with fake_cluster(CFG, replicas) as c, aiohttp.ClientSession() as s:
        canary_url = c.replicas[1].url
        put = {"url": canary_url, "group": "canary", "weight": 0.25}
        async with s.put(f"{c.url}/workers", json=put) as resp:
            assert resp.status == 401
        for bad, param, status in (({**put, "weight": 1.5}, "weight", 400),
                                   ({**put, "weight": "x"}, "weight", 400),
                                   ({**put, "group": "stable"}, "weight", 400),
                                   ({"group": "nope", "weight": 0.1}, "group", 400),
                                   ({**put, "url": "http://127.0.0.1:1"}, "url", 404)):
            async with s.put(f"{c.url}/workers", json=bad, headers=ADMIN) as resp:
                assert resp.status == status and (await resp.json())["error"]["param"] == param
        async with s.put(f"{c.url}/workers", json=put, headers=ADMIN) as resp:
            assert resp.status == 200
            groups = (await resp.json())["groups"]
        assert groups["canary"]["weight"] == 0.25 and groups["canary"]["workers"] == [canary_url]
        assert groups["stable"]["weight"] == 0.75

        names = {f"user-{i}": await served(s, c.url, f"user-{i}") for i in range(40)}
        for session, name in names.items():  # sticky, and where the fixed hash says
            assert await served(s, c.url, session) == name
            assert (name == "canary") == (split_point(session.encode()) < 0.25)
        num_canary = sum(n == "canary" for n in names.values())
        assert 0 < num_canary < 40
        async with s.get(f"{c.url}/metrics") as resp:
            text = await resp.text()
        assert metric(text, "group_requests_routed_total", "canary") == 2 * num_canary
        assert metric(text, "group_requests_routed_total", "stable") == 2 * (40 - num_canary)
        assert metric(text, "group_weight", "canary") == 0.25
        assert metric(text, "group_weight", "stable") == 0.75

        # Every session to the canary, which then fails: served by stable, counted.
        async with s.put(f"{c.url}/workers", json={"group": "canary", "weight": 1},
                         headers=ADMIN) as resp:
            assert resp.status == 200
        assert {await served(s, c.url, f"user-{i}") for i in range(5)} == {"canary"}
        c.replicas[1].healthy = False
        assert await served(s, c.url, "user-0") == "stable"
        async with s.get(f"{c.url}/metrics") as resp:
            text = await resp.text()
        assert metric(text, "group_worker_errors_total", "canary") == 1
        assert metric(text, "group_fallbacks_total", "canary") == 1
        assert metric(text, "group_worker_errors_total", "stable") == 0
        async with s.get(f"{c.url}/workers", headers=ADMIN) as resp:
            body = await resp.json()
        assert [w["group"] for w in body["workers"]] == ["stable", "canary"]
        assert body["groups"]["canary"]["errors"] == 1


async def test_post_workers_adds_straight_into_a_group() -> None:
    replicas = [FakeReplicaConfig(name="stable"), FakeReplicaConfig(name="canary")]
    async with fake_cluster(CFG, replicas[:1]) as c, aiohttp.ClientSession() as s:
        async with fake_cluster(CFG, replicas[1:]) as other:
            url = other.replicas[0].url
            async with s.post(f"{c.url}/workers", json={"url": url, "group": "canary",
                                                        "weight": 1.5}, headers=ADMIN) as resp:
                assert resp.status == 400
            async with s.get(f"{c.url}/workers", headers=ADMIN) as resp:
                assert len((await resp.json())["workers"]) == 1  # all or nothing
            async with s.post(f"{c.url}/workers", json={"url": url, "group": "canary",
                                                        "weight": 1.0}, headers=ADMIN) as resp:
                assert resp.status == 201 and (await resp.json())["group"] == "canary"
            assert {await served(s, c.url, f"u{i}") for i in range(6)} == {"canary"}
