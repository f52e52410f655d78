"""Speculative decoding's pure parts: the config, every draft source, the acceptance rule, the
adaptive draft length and the batch gate."""

from __future__ import annotations

import pytest

from radixserve.cache.radix_cache import RadixCache
from radixserve.config import ConfigError, EngineConfig
from radixserve.config.speculative_config import SpeculativeConfig
from radixserve.speculative.acceptance import (
    MIN_SAMPLES,
    PROBE_EVERY,
    DraftGate,
    DraftLength,
    accept_prefix,
)
from radixserve.speculative.drafter import Drafter, DraftRequest
from radixserve.speculative.ngram import as_tokens, lookup, ngram_draft
from radixserve.speculative.predicted_outputs import advance, realign
from radixserve.speculative.radix_drafts import RecentOutputs, tree_continuation

ISSUE_FLAG = ('{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, '
              '"prompt_lookup_min": 2}')


def test_the_issue_flag_parses_as_written() -> None:
    cfg = EngineConfig(speculative_config=ISSUE_FLAG)  # type: ignore[arg-type]
    assert cfg.speculative_config == SpeculativeConfig("ngram", 4, 4, 2)
    as_dict = EngineConfig(speculative_config={"method": "auto"})  # type: ignore[arg-type]
    assert as_dict.speculative_config is not None
    assert as_dict.speculative_config.method == "auto"


@pytest.mark.parametrize("bad, words", [
    ('{"method": "eagle"}', "unknown method 'eagle'"),
    ('{"method": "ngram", "num_speculative_tokens": 0}', "num_speculative_tokens"),
    ('{"method": "ngram", "prompt_lookup_max": 1, "prompt_lookup_min": 3}', "prompt_lookup_max"),
    ('{"method": "ngram", "model": "x"}', "unsupported key 'model'"),
    ('{"num_speculative_tokens": 4}', "'method' is required"),
    ("{method: ngram}", "not valid JSON"),
    ('["ngram"]', "JSON object"),
    ('{"method": "ngram", "num_speculative_tokens": "4"}', "must be an integer"),
])
def test_a_bad_config_is_a_clear_error(bad: str, words: str) -> None:
    with pytest.raises(ConfigError, match="speculative_config") as err:
        EngineConfig(speculative_config=bad)  # type: ignore[arg-type]
    assert words in str(err.value)


def test_cli_flag_and_bad_value_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    from radixserve.cli import build_config, build_parser, main

    args = build_parser().parse_args(["serve", "--speculative-config", ISSUE_FLAG])
    spec = build_config(args, {}).engine.speculative_config
    assert spec == SpeculativeConfig("ngram", 4, 4, 2)
    assert main(["serve", "--speculative-config", '{"method": "nope"}']) == 2
    assert "unknown method 'nope'" in capsys.readouterr().err


def test_prompt_lookup_takes_the_latest_longest_match() -> None:
    t = as_tokens([1, 2, 3, 4, 5, 9, 1, 2, 3, 7, 8, 0, 2, 3])
    # "2 3" occurs at 1 and 7: the latest (followed by 7 8 0 2) wins.
    assert ngram_draft(t, 3, 2, 4).tolist() == [7, 8, 0]
    # A longer n-gram decides first: "9 1 2 3" only occurs once, followed by 7.
    t2 = as_tokens([9, 1, 2, 3, 7, 5, 1, 2, 3, 6, 9, 1, 2, 3])
    assert ngram_draft(t2, 2, 2, 4).tolist() == [7, 5]
    assert ngram_draft(as_tokens([1, 2, 3, 4]), 4, 2, 4).tolist() == []
    assert ngram_draft(as_tokens([5]), 4, 1, 4).tolist() == []
    assert lookup(as_tokens([5, 6, 7, 5, 6]), as_tokens([5, 6]), 4).tolist() == [7, 5, 6]


def _cache_with(*seqs: list[int], salt: str = "", page_size: int = 1) -> RadixCache:
    cache = RadixCache(page_size)
    slot = 0
    for seq in seqs:
        n = len(seq) - len(seq) % page_size
        cache.insert(seq[:n], list(range(slot, slot + n)), salt)
        slot += n
    return cache


@pytest.mark.parametrize("page_size", [1, 2])
def test_tree_continuation_drafts_what_followed(page_size: int) -> None:
    cache = _cache_with([1, 2, 3, 4, 5, 6, 7, 8], page_size=page_size)
    assert tree_continuation(cache, [1, 2, 3], "", 3) == [4, 5, 6]
    assert tree_continuation(cache, [1, 2, 3, 4], "", 8) == [5, 6, 7, 8]
    assert tree_continuation(cache, [1, 2, 9], "", 3) == []
    assert tree_continuation(cache, [1, 2, 3, 4, 5, 6, 7, 8], "", 3) == []
    # Another namespace sees nothing: drafts never cross tenants.
    assert tree_continuation(cache, [1, 2, 3], "tenant-b", 3) == []
    before = (cache.evictable_size, cache.protected_size)
    cache.check_integrity()
    assert (cache.evictable_size, cache.protected_size) == before


def test_tree_continuation_follows_the_most_recent_branch() -> None:
    cache = _cache_with([1, 2, 3, 4, 4, 4], [1, 2, 3, 5, 5, 5])
    assert tree_continuation(cache, [1, 2, 3], "", 3) == [5, 5, 5]
    cache.match_prefix([1, 2, 3, 4, 4], "")  # touch the first branch
    assert tree_continuation(cache, [1, 2, 3], "", 3) == [4, 4, 4]


def test_recent_outputs_are_per_namespace_and_bounded() -> None:
    recent = RecentOutputs(capacity=12)
    recent.add("a", [10, 11, 12, 13, 14])
    assert recent.draft("a", as_tokens([7, 10, 11]), 4, 2, 4).tolist() == [12, 13, 14]
    assert recent.draft("b", as_tokens([7, 10, 11]), 4, 2, 4).tolist() == []
    for i in range(5):
        recent.add("a", [20 + i, 30 + i])
    assert recent.num_tokens("a") <= 12
    assert recent.draft("a", as_tokens([10, 11]), 4, 2, 4).tolist() == []  # aged out
    # An output's end is never drafted past (no n-gram spans two outputs).
    assert recent.draft("a", as_tokens([24]), 4, 1, 4).tolist() == [34]


def test_prediction_follows_edits() -> None:
    p = as_tokens([1, 2, 3, 4, 5, 6, 7, 8, 9])
    assert realign(p, as_tokens([]), 0, 8) == 0
    assert advance(p, 0, [1, 2]) == 2
    assert advance(p, 2, [3, 99]) is None  # an edit: alignment lost
    # The output's tail "5 6" is found again: drafting resumes after it.
    assert realign(p, as_tokens([1, 2, 3, 99, 5, 6]), 3, 8) == 6
    assert realign(p, as_tokens([42, 43]), 0, 8) is None
    # A repeated pattern: the first match at or after the hint wins.
    rep = as_tokens([1, 2, 7, 1, 2, 8])
    assert realign(rep, as_tokens([1, 2]), 3, 8) == 5
    assert realign(rep, as_tokens([1, 2]), 0, 8) == 2


def test_drafter_sources_and_prediction_alignment() -> None:
    cache = _cache_with([1, 2, 3, 4, 5, 6, 7, 8, 9, 10])
    auto = Drafter(SpeculativeConfig("auto", 4, 3, 1), cache)
    state = auto.new_state(None)
    assert state is not None
    req = DraftRequest([1, 2, 3], 3, "", None, 4)
    assert auto.propose(state, req) == [4, 5, 6, 7]  # the tree's continuation
    plain = Drafter(None, cache)
    assert plain.new_state(None) is None  # nothing drafts without a flag or a prediction
    pstate = plain.new_state([50, 51, 52, 53, 54, 55])
    assert pstate is not None
    assert plain.propose(pstate, DraftRequest([1, 2, 3], 3, "", None, 3)) == [50, 51, 52]
    plain.on_tokens(pstate, [50, 51], [50, 51])
    assert plain.propose(pstate, DraftRequest([1, 2, 3, 50, 51], 3, "", None, 3)) == [52, 53, 54]


def test_accept_prefix() -> None:
    assert accept_prefix([5, 6, 7], [5, 6, 7, 8]) == 3
    assert accept_prefix([5, 6, 7], [5, 9, 7, 8]) == 1
    assert accept_prefix([5], [4, 1]) == 0
    assert accept_prefix([], [3]) == 0
    with pytest.raises(AssertionError):
        accept_prefix([1, 2], [1, 2])


def test_draft_length_follows_acceptance_and_backs_off() -> None:
    dl = DraftLength(max_len=8)
    assert dl.next_len() == 8
    for _ in range(4):
        dl.observe(8, 1)
    assert dl.skip > 0 and dl.next_len() == 0  # keeps missing: drafting off for a while
    while dl.skip:
        dl.next_len()
    for _ in range(3):
        dl.observe(4, 4)
    assert dl.next_len() >= 6 and dl.backoff == 0
    dl.observe(4, 2)
    assert 1 < dl.next_len() < 8
    for _ in range(20):
        dl.observe_empty()
    assert 0 < dl.skip <= 8


def test_gate_keeps_the_faster_arm_and_probes_the_other() -> None:
    gate = DraftGate()
    decisions = []
    for _ in range(4 * MIN_SAMPLES):  # learning: both arms get measured
        drafted = gate.allow(32)
        decisions.append(drafted)
        # Drafting at batch 32 is slower here (compute-bound): 32 tokens in 0.2 s vs 0.1 s.
        gate.observe(32, drafted, 32, 0.2 if drafted else 0.1)
    assert True in decisions and False in decisions
    later = [gate.allow(32) for _ in range(4 * PROBE_EVERY)]
    assert later.count(True) == 4  # one probe per PROBE_EVERY steps
    # Another batch size is judged on its own: at batch 1 drafting pays.
    for _ in range(4 * MIN_SAMPLES):
        drafted = gate.allow(1)
        gate.observe(1, drafted, 3 if drafted else 1, 0.01)
    assert sum(gate.allow(1) for _ in range(PROBE_EVERY * 2)) == PROBE_EVERY * 2 - 2


def test_gate_drafts_only_where_it_clearly_pays() -> None:
    """A tie (compute-bound: drafted steps give the plain steps' tokens per second) is a
    loss; so is a gain inside the timing noise; a 30% gain is kept."""
    for gain, drafting in ((1.0, False), (1.1, False), (1.3, True)):
        gate = DraftGate()
        for _ in range(4 * MIN_SAMPLES):
            drafted = gate.allow(32)
            gate.observe(32, drafted, 96 if drafted else 32, 0.3 / gain if drafted else 0.1)
        later = [gate.allow(32) for _ in range(PROBE_EVERY)]
        assert later.count(True) == (PROBE_EVERY - 1 if drafting else 1), gain


def test_spec_state_converts_only_the_appended_tail() -> None:
    from radixserve.speculative.acceptance import DraftLength
    from radixserve.speculative.drafter import SpecState

    state = SpecState(DraftLength(4))
    ids = list(range(300))
    assert state.tokens(ids).tolist() == ids
    buf = state._buf
    ids += [7, 8, 9]
    assert state.tokens(ids).tolist() == ids and state._buf is buf  # appended in place
    ids = ids + list(range(1000))
    assert state.tokens(ids).tolist() == ids  # grown
    assert state.tokens([5, 6]).tolist() == [5, 6]  # shorter: converted again
    assert state.tokens([1, 7, 3]).tolist() == [1, 7, 3]  # its last token differs: again
