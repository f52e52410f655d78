"""Router units without HTTP: policies, the approximate index, route keys, precise state."""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from radixserve.api.api_keys import cache_salt_for_api_key
from radixserve.kv_events.publisher import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventBatch,
    block_hashes,
)
from radixserve.testing.fake_replica import ByteEncoder
from router.config import ConfigError, PolicyName, RouterConfig, normalize_worker_url
from router.core import Router
from router.routing.kv_index import PreciseIndex, split_sse
from router.routing.policy import (
    CacheAwarePolicy,
    Candidate,
    ChoiceReason,
    LeastLoadPolicy,
    RandomPolicy,
    RoundRobinPolicy,
)
from router.routing.prefix_index import ApproxPrefixIndex
from router.routing.route_key import (
    Prompt,
    RequestKind,
    RouteKey,
    approx_hashes,
    extract_prompt,
    salt_for,
    token_chains,
)

A, B, C = "http://a:1", "http://b:1", "http://c:1"


# --- policies --------------------------------------------------------------------------------

def test_round_robin_cycles() -> None:
    p = RoundRobinPolicy()
    cands = [Candidate(A, 5), Candidate(B, 0), Candidate(C, 9)]
    assert [p.choose(cands).url for _ in range(6)] == [A, B, C, A, B, C]


def test_least_load_picks_min_and_rotates_ties() -> None:
    p = LeastLoadPolicy()
    assert p.choose([Candidate(A, 3), Candidate(B, 1), Candidate(C, 2)]).url == B
    tied = [Candidate(A, 0), Candidate(B, 0), Candidate(C, 4)]
    assert {p.choose(tied).url for _ in range(4)} == {A, B}


def test_random_is_seeded_and_covers_all() -> None:
    cands = [Candidate(A, 0), Candidate(B, 0), Candidate(C, 0)]
    p1, p2 = RandomPolicy(7), RandomPolicy(7)
    seq = [p1.choose(cands).url for _ in range(30)]
    assert seq == [p2.choose(cands).url for _ in range(30)]
    assert set(seq) == {A, B, C}


def test_cache_aware_prefers_match_until_load_outweighs_it() -> None:
    p = CacheAwarePolicy(balance_lambda=0.5)
    # Equal load: the worker holding the prefix wins.
    choice = p.choose([Candidate(A, 2, 0.9), Candidate(B, 2, 0.0), Candidate(C, 2, 0.1)])
    assert choice == (A, ChoiceReason.PREFIX)
    # A holds all of it but is far busier: score(A) = 1 - 0.5 * (12 - 1) / 5 = -0.1 < 0.
    choice = p.choose([Candidate(A, 12, 1.0), Candidate(B, 1, 0.0), Candidate(C, 2, 0.0)])
    assert choice == (B, ChoiceReason.BALANCE)
    # Just below that point A still wins: 1 - 0.5 * (8 - 1) / 3.67 = 0.05 > 0.
    assert p.choose([Candidate(A, 8, 1.0), Candidate(B, 1, 0.0), Candidate(C, 2, 0.0)]).url == A


def test_cache_aware_miss_goes_to_least_loaded_not_one_worker() -> None:
    p = CacheAwarePolicy()
    cands = [Candidate(A, 0), Candidate(B, 0), Candidate(C, 3)]
    picks = [p.choose(cands) for _ in range(4)]
    assert all(c.reason is ChoiceReason.MISS for c in picks)
    assert Counter(c.url for c in picks) == {A: 2, B: 2}


# --- the approximate index -------------------------------------------------------------------

def test_index_longest_consecutive_match() -> None:
    idx = ApproxPrefixIndex(100)
    idx.record([1, 2, 3, 4], A)
    idx.record([1, 2, 9], B)
    assert idx.match([1, 2, 3, 4, 5], [A, B, C]) == {A: 4, B: 2, C: 0}
    assert idx.match([7, 2, 3], [A, B]) == {A: 0, B: 0}
    idx.check_integrity()


def test_index_memory_bound_forgets_tails_first() -> None:
    idx = ApproxPrefixIndex(10)
    for g in range(20):
        idx.record([g * 100 + i for i in range(4)], [A, B][g % 2])
        idx.check_integrity()
        assert len(idx) <= 10
    # 10 entries: the two newest prefixes whole, and the head half of the one before them.
    assert idx.match([1900, 1901, 1902, 1903], [A, B])[B] == 4
    assert idx.match([1800, 1801, 1802, 1803], [A, B])[A] == 4
    assert idx.match([1700, 1701, 1702, 1703], [A, B])[B] == 2
    assert idx.match([1600, 1601], [A, B]) == {A: 0, B: 0}


def test_index_drop_worker() -> None:
    idx = ApproxPrefixIndex(100)
    idx.record([1, 2, 3], A)
    idx.record([1, 2], B)
    assert idx.drop_worker(A) == 3 and idx.num_entries(A) == 0
    assert idx.match([1, 2, 3], [A, B]) == {A: 0, B: 2}
    idx.check_integrity()


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from([A, B, C]),
                          st.lists(st.integers(0, 30), min_size=0, max_size=6),
                          st.booleans()), max_size=40))
def test_index_property_bound_and_integrity(ops: list[tuple[str, list[int], bool]]) -> None:
    idx = ApproxPrefixIndex(12)
    for worker, hashes, drop in ops:
        if drop:
            idx.drop_worker(worker)
        else:
            idx.record(hashes, worker)
            # What was just recorded is fully matchable when it fits in the budget.
            if len(set(hashes)) == len(hashes) <= 12:
                assert idx.match(hashes, [worker])[worker] == len(hashes)
        idx.check_integrity()
        assert len(idx) <= 12


# --- route keys ------------------------------------------------------------------------------

def test_extract_prompt_shapes() -> None:
    comp, gen = RequestKind.COMPLETIONS, RequestKind.GENERATE
    assert extract_prompt(comp, {"prompt": "hi"}).text == "hi"
    assert extract_prompt(comp, {"prompt": ["first", "second"]}).text == "first"
    assert extract_prompt(comp, {"prompt": [5, 6]}).token_ids == [5, 6]
    assert extract_prompt(comp, {"prompt": [[5, 6], [7]]}).token_ids == [5, 6]
    assert extract_prompt(gen, {"input_ids": [1, 2]}).token_ids == [1, 2]
    assert extract_prompt(gen, {"text": "t"}).text == "t"
    assert extract_prompt(comp, {"prompt": [True, 2]}) == extract_prompt(comp, None)
    chat = extract_prompt(RequestKind.CHAT, {"messages": [{"role": "user", "content": "x"}],
                                             "add_generation_prompt": False})
    assert chat.messages is not None and chat.add_generation_prompt is False


def test_responses_request_is_keyed_as_its_chat() -> None:
    items = [{"role": "developer", "content": "Be brief."},
             {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "hi"}]}]
    resp = extract_prompt(RequestKind.RESPONSES, {"input": items, "instructions": "Rules."})
    chat = extract_prompt(RequestKind.CHAT, {"messages": [
        {"role": "system", "content": "Rules."}, {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "hi"}]})
    assert resp == chat and resp.messages is not None
    assert approx_hashes(resp, "", 64, 16) == approx_hashes(chat, "", 64, 16)
    text = extract_prompt(RequestKind.RESPONSES, {"input": "hello"})
    assert text.messages == [{"role": "user", "content": "hello"}]
    for bad in ({"input": []}, {"input": [{"type": "item_reference", "id": "x"}]}, {}, None):
        assert extract_prompt(RequestKind.RESPONSES, bad) == Prompt()  # the replica's 400


def test_chat_key_covers_whole_conversation() -> None:
    sys_msg = {"role": "system", "content": "You are helpful. " * 20}

    def key(*msgs: dict[str, str]) -> list[int]:
        return approx_hashes(extract_prompt(RequestKind.CHAT, {"messages": list(msgs)}), "", 64, 16)

    turn1 = key(sys_msg, {"role": "user", "content": "a" * 200})
    turn2 = key(sys_msg, {"role": "user", "content": "a" * 200},
                {"role": "assistant", "content": "b" * 100}, {"role": "user", "content": "c"})
    other = key(sys_msg, {"role": "user", "content": "z" * 200})
    assert turn2[: len(turn1) - 1] == turn1[:-1]  # turn 2 extends turn 1 (but its closing ])
    shared = sum(x == y for x, y in zip(turn1, other, strict=False))
    assert 0 < shared < len(turn1)  # same system prompt, a different user message: diverges


def test_salt_follows_bearer_key() -> None:
    assert salt_for("Bearer sk-1", True) == cache_salt_for_api_key("sk-1")
    assert salt_for("Bearer sk-1", False) == ""
    assert salt_for(None, True) == "" and salt_for("Basic abc", True) == ""
    prompt = extract_prompt(RequestKind.COMPLETIONS, {"prompt": "p" * 128})
    assert set(approx_hashes(prompt, "s1", 64, 16)).isdisjoint(approx_hashes(prompt, "s2", 64, 16))


def test_token_chains_match_the_replica_chain() -> None:
    enc = ByteEncoder()
    prompt = extract_prompt(RequestKind.COMPLETIONS, {"prompt": "q" * 40})
    ids = enc.encode_prompt("q" * 40)
    assert token_chains(prompt, ["s", ""], 16, enc) == [
        tuple(block_hashes(ids, 16, "s")), tuple(block_hashes(ids, 16, ""))]
    assert token_chains(prompt, [""], 16, None) == []


# --- precise state and the routing core ------------------------------------------------------

def test_precise_index_applies_events_and_pending() -> None:
    now = [0.0]
    idx = PreciseIndex(block_size=16, pending_ttl_s=5.0, clock=lambda: now[0])
    idx.add_worker(A)
    assert idx.match([1, 2], A) is None  # not live yet
    idx.set_live(A, True)
    idx.apply(A, EventBatch(1, (BlockStored((1, 2), None, (), 16),)))
    assert idx.match([1, 2, 3], A) == 2
    idx.note_routed([1, 2, 3, 4], A)
    assert idx.match([1, 2, 3, 4], A) == 4  # pending counts until its events arrive ...
    now[0] = 6.0
    assert idx.match([1, 2, 3, 4], A) == 2  # ... or its TTL passes
    idx.apply(A, EventBatch(2, (BlockRemoved((2,)),)))
    assert idx.match([1, 2], A) == 1
    idx.apply(A, EventBatch(3, (AllBlocksCleared(),)))
    assert idx.match([1], A) == 0 and idx.state(A).last_seq == 3  # type: ignore[union-attr]
    idx.apply(A, EventBatch(4, (BlockStored((1,), None, (), 32),)))
    assert idx.match([1], A) is None  # a replica hashing other block sizes cannot be trusted


def test_split_sse_frames() -> None:
    buf = bytearray(b'data: {"a":1}\n\n: keepalive\n\ndata: x\ndata: y\n\ndata: part')
    assert split_sse(buf) == [b'{"a":1}', b"x\ny"]
    assert bytes(buf) == b"data: part"


def test_router_precise_falls_back_to_approx_per_worker() -> None:
    cfg = RouterConfig(workers=(A, B), kv_events=True)
    router = Router(cfg, ByteEncoder())
    assert router.precise is not None
    key_hashes = block_hashes(list(b"z" * 64), 16)
    key = RouteKey(approx_hashes=(11, 12), token_chains=(tuple(key_hashes),))
    router.index.record([11, 12], A)  # the approximate index believes A
    router.precise.set_live(B, True)
    router.precise.apply(B, EventBatch(1, (BlockStored(tuple(key_hashes), None, (), 16),)))
    # A's stream is down: A is scored by the approximate index (2/2); B precisely (4/4).
    # Both are full matches; one request in flight on A breaks the tie.
    router.pool.get(A).in_flight = 1  # type: ignore[union-attr]
    decision = router.choose(key)
    assert decision is not None and decision.worker.url == B and decision.matched_blocks == 4
    router.precise.apply(B, EventBatch(2, (AllBlocksCleared(),)))
    decision = router.choose(key)
    assert decision is not None and decision.worker.url == A and decision.total_blocks == 2


def test_config_validation() -> None:
    assert normalize_worker_url("http://h:1/") == "http://h:1"
    for bad in ("h:1", "ftp://h", "http://h:99999", "http://h:1/?x=1"):
        with pytest.raises(ConfigError):
            normalize_worker_url(bad)
    with pytest.raises(ConfigError):
        RouterConfig(workers=(A, A))
    with pytest.raises(ConfigError):
        RouterConfig(kv_events=True, policy=PolicyName.ROUND_ROBIN)
    with pytest.raises(ConfigError):
        RouterConfig(policy="nope")  # type: ignore[arg-type]
    with pytest.raises(ConfigError):
        RouterConfig(index_max_entries=0)
