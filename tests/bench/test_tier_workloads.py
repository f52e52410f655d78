"""bench.common.tier_workloads and bench.tiers: agent sessions grow by exact token counts, each turn
extends the previous one, sessions share only the system prompt; the runner's flags and report."""

from __future__ import annotations

from pathlib import Path

import pytest
from transformers import PreTrainedTokenizerBase

from bench.common.tier_workloads import AgentSpec, build_agent_sessions, rag_corpus_spec
from bench.common.workloads import WorkloadError, build_workload
from bench.tiers import Trace, parse_args, report, system_argv
from radixserve.tokenizer import encode_prompt
from tests.tiny_models import make_tokenizer


@pytest.fixture(scope="module")
def tok() -> PreTrainedTokenizerBase:
    return make_tokenizer()


def test_agent_sessions_grow_exactly_and_share_the_system_prompt(
        tok: PreTrainedTokenizerBase) -> None:
    spec = AgentSpec(num_sessions=3, num_turns=4, system_prompt_len=20, user_len=5,
                     tool_call_len=3, tool_result_len=7, output_len=2, think_time_s=0)
    sessions = build_agent_sessions(spec, tok, seed=1)
    special = len(encode_prompt(tok, ""))
    assert len(sessions) == 3
    for s in sessions:
        ids = [encode_prompt(tok, p) for p in s.prompts]
        assert [len(i) for i in ids] == list(s.prompt_lens)
        assert list(s.prompt_lens) == [special + 25 + 10 * t for t in range(4)]
        for prev, cur in zip(ids, ids[1:], strict=False):
            assert cur[: len(prev)] == prev  # a turn extends the previous prompt, token-exact
    assert s.prompt_lens[-1] - special == spec.final_context_len
    a, b = (encode_prompt(tok, s.prompts[-1]) for s in sessions[:2])
    shared = next(i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y)
    assert special + 20 <= shared < special + 25  # the system prompt, then they differ
    assert spec.live_tokens == 20 + 3 * (spec.final_context_len - 20)
    assert build_agent_sessions(spec, tok, seed=1) == sessions
    assert build_agent_sessions(spec, tok, seed=2) != sessions
    with pytest.raises(WorkloadError):
        AgentSpec(num_sessions=0)


def test_rag_corpus_uses_one_document_per_request(tok: PreTrainedTokenizerBase) -> None:
    spec = rag_corpus_spec(10, 4, 30, 8, 5, 2, 0.6)
    w = build_workload(spec, tok, 0)
    assert len(w.requests) == 10
    assert {r.prompt_len for r in w.requests} == {len(encode_prompt(tok, "")) + 8 + 30 + 5}


def test_system_flags_and_report(tmp_path: Path) -> None:
    args = parse_args(["--kv-cache-tokens", "4096", "--offload-size", "2"])
    trace = Trace("agent", 10_000, None)  # type: ignore[arg-type]
    on = system_argv("on", args, trace, tmp_path)
    assert on[-6:] == ("--kv-cache-tokens", "4096", "--kv-offload-dir", str(tmp_path),
                       "--kv-offload-size", "2.0")
    assert system_argv("shared", args, trace, tmp_path)[-2:] == ("--kv-shared-dir",
                                                                str(tmp_path))
    inf = system_argv("infinite", args, trace, tmp_path)
    assert int(inf[inf.index("--kv-cache-tokens") + 1]) >= 2 * 10_000
    row = {"TTFT p50 s": 1.0, "TTFT p90 s": 4.0, "output tok/s": 10.0, "hit rate": 0.5,
           "failed": 0.0, "duration s": 9.0}
    text = report("agent", {"off": row, "on": {**row, "TTFT p90 s": 1.0, "hit rate": 0.45},
                            "infinite": row}, 1)
    assert "TTFT p90 off/on: 4.00x" in text and "hit rate on/infinite: 0.90x" in text


def test_tier_restart_flags_and_stats() -> None:
    from bench.common.metrics import RequestResult
    from bench.common.tier_workloads import Session
    from bench.tier_restart import (
        Shutdown,
        TurnStats,
        parse_args,
        report,
        server_argv,
        turn_stats,
    )

    args = parse_args(["--kv-cache-tokens", "1024", "--radixserve-args", "--max-model-len 512"])
    argv = server_argv(args, "--kv-offload-dir", "/d")
    assert argv[-8:] == ("--kv-cache-tokens", "1024",
                         "--kv-offload-shutdown-timeout", str(args.shutdown_timeout),
                         "--max-model-len", "512", "--kv-offload-dir", "/d")
    by_bytes = server_argv(parse_args(["--kv-cache-memory-bytes", "2G"]))
    assert by_bytes[-4:-2] == ("--kv-cache-memory-bytes", "2G")
    assert "--kv-cache-tokens" not in by_bytes
    with pytest.raises(SystemExit):
        parse_args(["--turns", "1"])
    sessions = [Session(("a", "ab"), (100, 200)), Session(("c", "cd"), (50, 80))]

    def res(cached: int, text: str, ttft: float, ok: bool = True) -> RequestResult:
        return RequestResult(ok=ok, send_time=0.0, prompt_len=0, expected_output_len=4,
                             cached_tokens=cached, chunk_times=[ttft], text=text)

    cold = [res(0, "x", 2.0), res(0, "y", 4.0)]
    warm = [res(96, "x", 0.5), res(48, "z", 1.0)]
    s = turn_stats(warm, sessions, cold)
    assert (s.cached_frac_min, s.cached_frac_median) == (0.96, 0.96)
    assert (s.same_text, s.failed, s.ttft_p90) == (1, 0, 1.0)
    failed = turn_stats([res(0, "", 0.1, ok=False), warm[1]], sessions, cold)
    assert (failed.failed, failed.same_text) == (1, 0)
    runs = [{"cold": turn_stats(cold, sessions, None), "restart": s, "replica": s}]
    down = Shutdown(seconds=24.2, persist_s=21.5, dropped=0, local_bytes=2 * 2**30)
    table = report(runs, [down], 2)
    assert "2 sessions; the first server's clean stop: 24.2 s (pool written in 21.5 s)" in table
    assert "0 block writes dropped, local tier 2.00 GiB" in table
    assert "| restart | 0.5 | 1 | 0.960 | 0.960 | 1/2 | 0 |" in table
    assert "TTFT p50 cold/restart: 4.00x" in table
    assert isinstance(s, TurnStats)


def test_tier_restart_reads_the_shutdown_from_the_log(tmp_path: Path) -> None:
    from bench.tier_restart import shutdown_stats

    log, local = tmp_path / "server.log", tmp_path / "local"
    local.mkdir()
    (local / "a.kvb").write_bytes(b"x" * 10)
    log.write_text("KV tiers: 3 block writes not done\n"
                   "KV tiers: every pending block written in 9.5 s\n")
    down = shutdown_stats(1.5, log, local)
    assert (down.seconds, down.persist_s, down.dropped, down.local_bytes) == (1.5, 9.5, 3, 10)
