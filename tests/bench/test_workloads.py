"""bench.common.workloads: exact token counts and the sharing structure each workload promises."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from transformers import PreTrainedTokenizerBase

from bench.common.workloads import (
    JsonlSpec,
    MultiTurnSpec,
    PiecePool,
    RagSpec,
    RandomSpec,
    SharedPrefixSpec,
    WorkloadError,
    WorkloadKind,
    build_workload,
)
from radixserve.tokenizer import encode_prompt
from tests.tiny_models import make_tokenizer


@pytest.fixture(scope="module")
def tok() -> PreTrainedTokenizerBase:
    return make_tokenizer()


def _ids(tok: PreTrainedTokenizerBase, text: str) -> list[int]:
    return encode_prompt(tok, text)


def _lcp(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def test_piece_pool_is_single_token_and_additive(tok: PreTrainedTokenizerBase) -> None:
    pool = PiecePool(tok)
    assert len(pool.pieces) >= 26
    for piece in pool.pieces:
        assert len(tok.encode(piece, add_special_tokens=False)) == 1
    import numpy as np

    text = pool.text(np.random.default_rng(1), 333)
    assert len(_ids(tok, text)) == 333 + pool.special_len


def test_shared_prefix_counts_and_sharing(tok: PreTrainedTokenizerBase) -> None:
    spec = SharedPrefixSpec(num_groups=3, prompts_per_group=5, system_prompt_len=40,
                            question_len=7, output_len=9)
    w = build_workload(spec, tok, seed=3)
    assert w.kind is WorkloadKind.SHARED_PREFIX and w.num_requests == 15
    by_group: dict[int, list[list[int]]] = {}
    for r in w.requests:
        ids = _ids(tok, r.prompt)
        assert len(ids) == r.prompt_len == 47 and r.output_len == 9
        by_group.setdefault(r.group, []).append(ids)
    assert sorted(by_group) == [0, 1, 2] and all(len(v) == 5 for v in by_group.values())
    for prompts in by_group.values():
        # The whole group shares exactly S tokens: every pair at least S, some pair exactly S.
        pair_lcps = [_lcp(a, b) for i, a in enumerate(prompts) for b in prompts[i + 1:]]
        assert min(pair_lcps) == 40 and max(pair_lcps) == 40
    firsts = [v[0] for v in by_group.values()]
    for i, a in enumerate(firsts):
        for b in firsts[i + 1:]:
            assert _lcp(a, b) == 0  # different groups: distinct first pieces
    # One warm-up prompt per group: it shares the system prompt, never a measured prompt.
    assert len(w.warmup_prompts) == 3
    measured = {r.prompt for r in w.requests}
    for warm in w.warmup_prompts:
        assert warm not in measured
        assert max(_lcp(_ids(tok, warm), p) for v in by_group.values() for p in v) == 40


def test_seeded_and_seed_sensitive(tok: PreTrainedTokenizerBase) -> None:
    spec = SharedPrefixSpec(prompts_per_group=4, system_prompt_len=20, question_len=4)
    a, b = build_workload(spec, tok, 1), build_workload(spec, tok, 1)
    c = build_workload(spec, tok, 2)
    assert a.requests == b.requests
    assert a.requests != c.requests


def test_rag_counts_and_shared_parts(tok: PreTrainedTokenizerBase) -> None:
    spec = RagSpec(num_requests=24, num_docs=6, doc_len=15, docs_per_request=2,
                   system_prompt_len=30, question_len=5, output_len=4, zipf_a=1.2)
    w = build_workload(spec, tok, seed=0)
    system = w.warmup_prompts[0][:30]  # one letter per token for the byte tokenizer
    doc_hits: dict[str, int] = {}
    for r in w.requests:
        assert r.prompt_len == len(_ids(tok, r.prompt)) == 30 + 2 * 15 + 5
        assert r.prompt.startswith(system)
        docs = r.prompt[30:30 + 15], r.prompt[45:60]
        assert docs[0] != docs[1]
        for d in docs:
            doc_hits[d] = doc_hits.get(d, 0) + 1
    assert len(doc_hits) <= 6  # drawn from the pool of D documents
    # zipf-ish: the most popular document appears in most requests, more than the rarest.
    counts = sorted(doc_hits.values(), reverse=True)
    assert counts[0] > counts[-1] and counts[0] >= 24 // 3
    # Sorted by popularity rank: requests that drew the hottest doc share system + that doc.
    prompts = [_ids(tok, r.prompt) for r in w.requests]
    assert max(_lcp(a, b) for i, a in enumerate(prompts) for b in prompts[i + 1:]) >= 45


def test_random_has_no_sharing(tok: PreTrainedTokenizerBase) -> None:
    w = build_workload(RandomSpec(num_requests=20, input_len=50, output_len=3), tok, 5)
    prompts = [_ids(tok, r.prompt) for r in w.requests]
    assert all(len(p) == 50 for p in prompts)
    assert max(_lcp(a, b) for i, a in enumerate(prompts) for b in prompts[i + 1:]) == 0
    assert w.warmup_prompts[0] not in {r.prompt for r in w.requests}


def test_multi_turn_messages_exact(tok: PreTrainedTokenizerBase) -> None:
    w = build_workload(MultiTurnSpec(num_conversations=3, num_turns=4, user_len=11,
                                     output_len=5), tok, 0)
    assert w.kind is WorkloadKind.MULTI_TURN and not w.requests
    assert w.num_requests == 12
    for conv in w.conversations:
        assert len(conv.user_messages) == 4 and conv.output_len == 5
        assert all(len(tok.encode(m, add_special_tokens=False)) == 11
                   for m in conv.user_messages)


def test_jsonl(tok: PreTrainedTokenizerBase, tmp_path: Path) -> None:
    path = tmp_path / "p.jsonl"
    rows = [{"prompt": "shared head, then one", "max_tokens": 3},
            {"prompt": "shared head, then two"}]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n\n")
    w = build_workload(JsonlSpec(str(path), default_output_len=7), tok)
    assert [r.output_len for r in w.requests] == [3, 7]
    assert [r.prompt_len for r in w.requests] == [len(_ids(tok, r["prompt"])) for r in rows]
    assert w.warmup_prompts == (os.path.commonprefix([r["prompt"] for r in rows]),)
    path.write_text('{"max_tokens": 3}\n')
    with pytest.raises(WorkloadError, match="p.jsonl:1"):
        build_workload(JsonlSpec(str(path)), tok)


def test_invalid_specs_raise_typed_errors() -> None:
    with pytest.raises(WorkloadError):
        SharedPrefixSpec(num_groups=0)
    with pytest.raises(WorkloadError):
        RagSpec(num_docs=2, docs_per_request=3)
    with pytest.raises(WorkloadError):
        RandomSpec(input_len=-1)


def _trained_bpe() -> PreTrainedTokenizerBase:
    """A GPT-2-style byte-level BPE with real merges, trained in memory on made-up words."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    words = [a + b + c for a in "bcdfgkl" for b in "aeiou" for c in "mnprst"]
    corpus = [" ".join(words[i:] + words[:i]) for i in range(0, len(words), 7)]
    tk = Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=600, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tk.train_from_iterator(corpus, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tk)


def test_word_pieces_with_a_merging_bpe() -> None:
    tok = _trained_bpe()
    pool = PiecePool(tok)
    assert all(p.startswith(" ") and len(p) >= 4 for p in pool.pieces)  # words, not letters
    spec = SharedPrefixSpec(num_groups=2, prompts_per_group=6, system_prompt_len=64,
                            question_len=8, output_len=2)
    w = build_workload(spec, tok, seed=0)
    for r in w.requests:
        assert len(tok.encode(r.prompt)) == r.prompt_len == 72


def test_help_lists_workload_names_not_enum_reprs() -> None:
    import argparse

    from bench.common.workloads import add_workload_args

    parser = argparse.ArgumentParser()
    add_workload_args(parser)
    text = parser.format_help()
    assert "{shared-prefix,multi-turn,rag,random,jsonl}" in text
    assert "WorkloadKind" not in text
    assert parser.parse_args(["--workload", "random"]).workload.value == "random"
