"""Seeded benchmark workloads whose token counts are exact for the served model's tokenizer.

Owns: the workload specs (frozen, validated), the prompts they expand to, and the sharing
structure each one promises. Does not know: HTTP, servers, timing.

How counts are made exact: prompts are concatenations of *pieces*, strings that each encode to
exactly one token and that concatenate additively (for GPT-2-style BPE: " word" vocabulary
entries, split apart by the pre-tokenizer at every space; for byte-level tokenizers: single
letters). Every built prompt is re-encoded and checked, so a tokenizer that breaks the
assumption fails loudly (`WorkloadError`) instead of skewing the benchmark.

Sharing structure:
    shared-prefix  G groups x P prompts: system prompt (S) + question (Q). The P prompts of a
                   group share exactly S tokens; groups, and questions within a group, start
                   with distinct pieces, so they share nothing beyond special tokens.
    rag            fixed system prompt (S) + k of D documents (L each, zipf popularity, sorted
                   by popularity rank so hot documents form shared prefixes) + question (Q).
    multi-turn     C conversations x T user messages of U tokens each; the client builds each
                   turn as previous prompt + the server's answer + the next message.
    random         independent prompts of I tokens (the control: no sharing).
    jsonl          {"prompt": ..., "max_tokens": ...} lines, counted with the tokenizer.
"""

from __future__ import annotations

import argparse
import json
import os
import re
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from enum import Enum
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from radixserve.tokenizer import encode_prompt

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


class WorkloadError(ValueError):
    """A workload cannot be built as asked (bad spec, or a tokenizer we cannot count exactly)."""


class WorkloadKind(str, Enum):
    SHARED_PREFIX = "shared-prefix"
    MULTI_TURN = "multi-turn"
    RAG = "rag"
    RANDOM = "random"
    JSONL = "jsonl"

    def __str__(self) -> str:  # argparse's --help and errors show the name users type
        return self.value


def check_spec(spec: Any, non_negative: tuple[str, ...] = ()) -> None:
    """A spec dataclass's fields: counts (every field not named) must be >= 1, and the
    `non_negative` ones (rates, exponents, delays) >= 0; raises WorkloadError."""
    for name, v in asdict(spec).items():
        low = 0 if name in non_negative else 1
        if v < low:
            raise WorkloadError(f"{name} must be >= {low}, got {v}")


@dataclass(frozen=True)
class SharedPrefixSpec:
    num_groups: int = 1
    prompts_per_group: int = 32
    system_prompt_len: int = 500
    question_len: int = 16
    output_len: int = 32

    def __post_init__(self) -> None:
        check_spec(self)


@dataclass(frozen=True)
class MultiTurnSpec:
    num_conversations: int = 8
    num_turns: int = 4
    user_len: int = 64
    output_len: int = 32

    def __post_init__(self) -> None:
        check_spec(self)


@dataclass(frozen=True)
class RagSpec:
    num_requests: int = 32
    num_docs: int = 16
    doc_len: int = 200
    docs_per_request: int = 2
    system_prompt_len: int = 200
    question_len: int = 16
    output_len: int = 32
    zipf_a: float = 1.0  # popularity of document i is proportional to 1 / (i + 1) ** zipf_a

    def __post_init__(self) -> None:
        check_spec(self, non_negative=("zipf_a",))
        if self.docs_per_request > self.num_docs:
            raise WorkloadError("docs_per_request must be <= num_docs")


@dataclass(frozen=True)
class RandomSpec:
    num_requests: int = 32
    input_len: int = 516
    output_len: int = 32

    def __post_init__(self) -> None:
        check_spec(self)


@dataclass(frozen=True)
class JsonlSpec:
    path: str
    default_output_len: int = 32

    def __post_init__(self) -> None:
        if self.default_output_len < 1:
            raise WorkloadError(f"default_output_len must be >= 1, got {self.default_output_len}")


WorkloadSpec = SharedPrefixSpec | MultiTurnSpec | RagSpec | RandomSpec | JsonlSpec


@dataclass(frozen=True)
class BenchRequest:
    prompt: str
    prompt_len: int  # tokens the server counts for /v1/completions (encode_prompt, specials too)
    output_len: int
    group: int = 0  # the shared prefix it belongs to (shared-prefix), else 0


@dataclass(frozen=True)
class Conversation:
    user_messages: tuple[str, ...]  # one per turn, each exactly MultiTurnSpec.user_len tokens
    output_len: int


@dataclass(frozen=True)
class Workload:
    """Either single-shot `requests` or sequential `conversations`, never both."""

    kind: WorkloadKind
    spec: WorkloadSpec
    seed: int
    requests: tuple[BenchRequest, ...] = ()
    conversations: tuple[Conversation, ...] = ()
    warmup_prompts: tuple[str, ...] = ()  # carry the shared prefixes, never a measured prompt
    # Counts the tokens of a prompt built at run time (multi-turn) when the server's usage
    # does not; the same count as BenchRequest.prompt_len.
    count_tokens: Callable[[str], int] | None = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        assert bool(self.requests) != bool(self.conversations), "exactly one of the two"

    @property
    def num_requests(self) -> int:
        turns = sum(len(c.user_messages) for c in self.conversations)
        return len(self.requests) + turns

    def describe(self) -> dict[str, Any]:
        return {"kind": self.kind.value, "seed": self.seed, **asdict(self.spec),
                "num_requests": self.num_requests}


_WORD_RE = re.compile(r"^ [a-z]{3,12}$")
_PROBE_PIECES = 256


class PiecePool:
    """Strings that each encode to one token and whose concatenations stay additive."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase) -> None:
        self.tokenizer = tokenizer
        self.special_len = len(encode_prompt(tokenizer, ""))
        for find in (self._words, self._letters):
            candidates = find()
            if len(candidates) >= 26 and self._additive(candidates):
                self.pieces: tuple[str, ...] = tuple(candidates)
                return
        raise WorkloadError("cannot find single-token pieces that concatenate exactly "
                            "for this tokenizer")

    def _single_token(self, texts: list[str]) -> list[str]:
        if not texts:
            return []
        encoded = self.tokenizer(texts, add_special_tokens=False)["input_ids"]
        return sorted({t for t, ids in zip(texts, encoded, strict=True) if len(ids) == 1})

    def _words(self) -> list[str]:
        ids = list(range(len(self.tokenizer)))
        texts = self.tokenizer.batch_decode([[i] for i in ids])
        return self._single_token([t for t in texts if _WORD_RE.match(t)])

    def _letters(self) -> list[str]:
        return self._single_token([chr(c) for c in [*range(65, 91), *range(97, 123)]])

    def _additive(self, candidates: list[str]) -> bool:
        rng = np.random.default_rng(0)
        probe = "".join(rng.choice(candidates, _PROBE_PIECES))
        return len(self.tokenizer.encode(probe, add_special_tokens=False)) == _PROBE_PIECES

    def text(self, rng: np.random.Generator, num_tokens: int, first: str | None = None) -> str:
        picks = rng.choice(len(self.pieces), num_tokens if first is None else num_tokens - 1)
        return (first or "") + "".join(self.pieces[i] for i in picks)

    def distinct_texts(self, rng: np.random.Generator, count: int, num_tokens: int) -> list[str]:
        """`count` texts whose first pieces differ pairwise (when the pool is large enough)."""
        replace = count > len(self.pieces)
        firsts = rng.choice(len(self.pieces), count, replace=replace)
        return [self.text(rng, num_tokens, first=self.pieces[i]) for i in firsts]

    def count(self, prompt: str) -> int:
        return len(encode_prompt(self.tokenizer, prompt))

    def checked(self, prompt: str, body_len: int) -> int:
        """The server-side count of `prompt`, after checking it is exactly what was built."""
        n = self.count(prompt)
        if n != body_len + self.special_len:
            raise WorkloadError(f"prompt encodes to {n} tokens, built for "
                                f"{body_len} + {self.special_len} special")
        return n


def _shared_prefix(pool: PiecePool, spec: SharedPrefixSpec, rng: np.random.Generator
                   ) -> tuple[list[BenchRequest], list[str]]:
    systems = pool.distinct_texts(rng, spec.num_groups, spec.system_prompt_len)
    body_len = spec.system_prompt_len + spec.question_len
    reqs, warm = [], []
    for g, system in enumerate(systems):
        # One extra question per group is the warm-up's, so no measured prompt is pre-cached.
        questions = pool.distinct_texts(rng, spec.prompts_per_group + 1, spec.question_len)
        warm.append(system + questions.pop())
        reqs += [BenchRequest(system + q, pool.checked(system + q, body_len), spec.output_len, g)
                 for q in questions]
    order = rng.permutation(len(reqs))  # groups interleave in arrival order, as in SGLang
    return [reqs[i] for i in order], warm


def _rag(pool: PiecePool, spec: RagSpec, rng: np.random.Generator
         ) -> tuple[list[BenchRequest], list[str]]:
    system = pool.text(rng, spec.system_prompt_len)
    docs = pool.distinct_texts(rng, spec.num_docs, spec.doc_len)
    weights = 1.0 / np.arange(1, spec.num_docs + 1) ** spec.zipf_a
    probs = weights / weights.sum()
    body_len = spec.system_prompt_len + spec.docs_per_request * spec.doc_len + spec.question_len
    questions = pool.distinct_texts(rng, spec.num_requests + 1, spec.question_len)
    reqs = []
    for q in questions[:-1]:
        chosen = sorted(rng.choice(spec.num_docs, spec.docs_per_request, replace=False, p=probs))
        prompt = system + "".join(docs[i] for i in chosen) + q
        reqs.append(BenchRequest(prompt, pool.checked(prompt, body_len), spec.output_len))
    return reqs, [system + questions[-1]]


def _random(pool: PiecePool, spec: RandomSpec, rng: np.random.Generator
            ) -> tuple[list[BenchRequest], list[str]]:
    texts = pool.distinct_texts(rng, spec.num_requests + 1, spec.input_len)
    reqs = [BenchRequest(t, pool.checked(t, spec.input_len), spec.output_len) for t in texts[1:]]
    return reqs, [texts[0]]


def _jsonl(pool: PiecePool, spec: JsonlSpec) -> tuple[list[BenchRequest], list[str]]:
    reqs = []
    with open(spec.path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                prompt, out_len = str(row["prompt"]), int(row.get("max_tokens",
                                                                  spec.default_output_len))
            except (ValueError, KeyError, TypeError) as e:
                raise WorkloadError(f"{spec.path}:{lineno}: {e}") from e
            reqs.append(BenchRequest(prompt, pool.count(prompt), out_len))
    if not reqs:
        raise WorkloadError(f"{spec.path} holds no prompts")
    common = os.path.commonprefix([r.prompt for r in reqs])
    return reqs, ([common] if common else [])


def build_workload(spec: WorkloadSpec, tokenizer: PreTrainedTokenizerBase, seed: int = 0
                   ) -> Workload:
    """Expand `spec` into prompts for `tokenizer`; the same seed gives the same prompts."""
    pool = PiecePool(tokenizer)
    rng = np.random.default_rng(seed)
    if isinstance(spec, MultiTurnSpec):
        convs = tuple(
            Conversation(tuple(pool.distinct_texts(rng, spec.num_turns, spec.user_len)),
                         spec.output_len)
            for _ in range(spec.num_conversations))
        return Workload(WorkloadKind.MULTI_TURN, spec, seed, conversations=convs,
                        warmup_prompts=(pool.text(rng, spec.user_len),), count_tokens=pool.count)
    if isinstance(spec, SharedPrefixSpec):
        kind, (reqs, warm) = WorkloadKind.SHARED_PREFIX, _shared_prefix(pool, spec, rng)
    elif isinstance(spec, RagSpec):
        kind, (reqs, warm) = WorkloadKind.RAG, _rag(pool, spec, rng)
    elif isinstance(spec, RandomSpec):
        kind, (reqs, warm) = WorkloadKind.RANDOM, _random(pool, spec, rng)
    else:
        kind, (reqs, warm) = WorkloadKind.JSONL, _jsonl(pool, spec)
    return Workload(kind, spec, seed, requests=tuple(reqs), warmup_prompts=tuple(warm))


def spec_from_args(kind: WorkloadKind, args: Any) -> WorkloadSpec:
    """The spec for `kind` from parsed CLI flags (bench.serving and bench.compare share them)."""
    if kind is WorkloadKind.SHARED_PREFIX:
        return SharedPrefixSpec(args.num_groups, args.prompts_per_group, args.system_prompt_len,
                                args.question_len, args.output_len)
    if kind is WorkloadKind.MULTI_TURN:
        return MultiTurnSpec(args.num_conversations, args.num_turns, args.user_len,
                             args.output_len)
    if kind is WorkloadKind.RAG:
        return RagSpec(args.num_prompts, args.num_docs, args.doc_len, args.docs_per_request,
                       args.system_prompt_len, args.question_len, args.output_len, args.zipf_a)
    if kind is WorkloadKind.RANDOM:
        return RandomSpec(args.num_prompts, args.input_len, args.output_len)
    if args.dataset_path is None:
        raise WorkloadError("--workload jsonl needs --dataset-path")
    return JsonlSpec(str(Path(args.dataset_path)), args.output_len)


def add_workload_args(p: argparse.ArgumentParser) -> None:
    """Workload flags shared by bench.serving and bench.compare (defaults: the reference one)."""
    g = p.add_argument_group("workload")
    g.add_argument("--model", default="smollm2-135m",
                   help="model spec whose tokenizer counts tokens (as `radixserve serve --model`)")
    g.add_argument("--tokenizer", default=None, help="an HF folder to take the tokenizer from")
    g.add_argument("--workload", type=WorkloadKind, default=WorkloadKind.SHARED_PREFIX,
                   choices=list(WorkloadKind))
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--output-len", type=int, default=32)
    g.add_argument("--num-groups", type=int, default=1)
    g.add_argument("--prompts-per-group", type=int, default=32)
    g.add_argument("--system-prompt-len", type=int, default=500)
    g.add_argument("--question-len", type=int, default=16)
    g.add_argument("--num-prompts", type=int, default=32, help="rag and random")
    g.add_argument("--input-len", type=int, default=516, help="random")
    g.add_argument("--num-docs", type=int, default=16, help="rag")
    g.add_argument("--doc-len", type=int, default=200, help="rag")
    g.add_argument("--docs-per-request", type=int, default=2, help="rag")
    g.add_argument("--zipf-a", type=float, default=1.0, help="rag document popularity")
    g.add_argument("--num-conversations", type=int, default=8, help="multi-turn")
    g.add_argument("--num-turns", type=int, default=4, help="multi-turn")
    g.add_argument("--user-len", type=int, default=64, help="multi-turn")
    g.add_argument("--dataset-path", default=None, help="jsonl")


def load_workload(args: argparse.Namespace) -> Workload:
    """Tokenizer of the served model (or --tokenizer), then the workload for the flags."""
    from radixserve.model_source import resolve_model
    from radixserve.tokenizer import load_tokenizer

    hf_dir = args.tokenizer or resolve_model(args.model).hf_dir
    return build_workload(spec_from_args(args.workload, args), load_tokenizer(hf_dir), args.seed)
