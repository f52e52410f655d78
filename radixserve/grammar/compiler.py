"""Grammar compilation off the step loop, with a cache of compiled grammars by Constraint.key.

Owns: the worker pool and the compiled-grammar cache (LRU-bounded). The scheduler calls
`request(constraint)` when a constrained request arrives and `poll(constraint)` while it
waits: the step loop never blocks on a compile. Identical specs compile once, even when their
requests arrive together (one future per key).
The backend (the tokenizer's llguidance view, slow to build) is created on the first compile,
on a worker thread: engines that never see a constrained request never pay for it.
Does not know: requests, batches, tensors.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass

from radixserve.constraints import Constraint
from radixserve.grammar.backend import CompiledGrammar, GrammarBackend, GrammarError

MAX_CACHED = 256


@dataclass(frozen=True)
class CompileFailed:
    message: str


class GrammarCompiler:
    def __init__(self, backend_factory: Callable[[], GrammarBackend], num_threads: int = 1,
                 max_cached: int = MAX_CACHED) -> None:
        self._backend_factory = backend_factory
        self._backend: GrammarBackend | None = None
        self._backend_lock = threading.Lock()
        self._pool = ThreadPoolExecutor(num_threads, thread_name_prefix="grammar")
        self._futures: dict[str, Future[CompiledGrammar]] = {}  # in flight
        self._done: OrderedDict[str, CompiledGrammar | CompileFailed] = OrderedDict()
        self._max_cached = max_cached
        self.counters = {"grammar_compiles": 0, "grammar_cache_hits": 0}

    def request(self, constraint: Constraint) -> None:
        """Start compiling unless cached or in flight."""
        key = constraint.key
        if key in self._done:
            self._done.move_to_end(key)
            self.counters["grammar_cache_hits"] += 1
        elif key not in self._futures:
            self.counters["grammar_compiles"] += 1
            self._futures[key] = self._pool.submit(self._compile, constraint)

    def _compile(self, constraint: Constraint) -> CompiledGrammar:  # on a worker thread
        with self._backend_lock:
            if self._backend is None:
                self._backend = self._backend_factory()
        return self._backend.compile(constraint)

    def wait_any(self, timeout: float) -> None:
        """Block up to `timeout` s until some compile in flight finishes (an idle engine
        waiting only on grammars sleeps here instead of spinning)."""
        if self._futures:
            wait(list(self._futures.values()), timeout, FIRST_COMPLETED)

    def poll(self, constraint: Constraint) -> CompiledGrammar | CompileFailed | None:
        """The compiled grammar, the failure, or None while still compiling."""
        key = constraint.key
        done = self._done.get(key)
        if done is not None:
            return done
        fut = self._futures.get(key)
        if fut is None:  # evicted from the cache since request(): compile again
            self.request(constraint)
            return None
        if not fut.done():
            return None
        del self._futures[key]
        err = fut.exception()
        if isinstance(err, GrammarError):
            result: CompiledGrammar | CompileFailed = CompileFailed(str(err))
        elif err is not None:
            result = CompileFailed(f"grammar compilation failed: {type(err).__name__}: {err}")
        else:
            result = fut.result()
        self._done[key] = result
        while len(self._done) > self._max_cached:
            self._done.popitem(last=False)
        return result

    def wait(self, constraint: Constraint) -> CompiledGrammar | CompileFailed:
        """Blocking: for tests and benchmarks, never the step loop."""
        self.request(constraint)
        fut = self._futures.get(constraint.key)
        if fut is not None:
            fut.exception()  # blocks until done
        result = self.poll(constraint)
        assert result is not None
        return result

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
