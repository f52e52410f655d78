"""Checking request constraints (JSON schemas, tool lists) with a memory of what passed.

Owns: ConstraintChecker, check_constraint (radixserve/grammar/validate.py: compiles the grammar
without a tokenizer: too slow to repeat per request) behind a bounded LRU set of constraint keys that passed,
so an agent that sends the same tools every turn pays for the check once, not on every
request on the event loop. Failures are not remembered (they are rare, and a 400 anyway).
Does not know: requests, HTTP, grammars.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable

from radixserve.constraints import Constraint
from radixserve.grammar.validate import check_constraint

Check = Callable[[Constraint, str], None]  # raises InvalidRequestError(param=...) when invalid


class ConstraintChecker:
    def __init__(self, capacity: int = 4096, allow_additional_properties: bool = False) -> None:
        assert capacity >= 1
        self._capacity = capacity
        self._allow_additional_properties = allow_additional_properties
        self._passed: OrderedDict[str, None] = OrderedDict()

    def __call__(self, constraint: Constraint, param: str) -> None:
        key = constraint.key
        if key in self._passed:
            self._passed.move_to_end(key)
            return
        check_constraint(constraint, param, self._allow_additional_properties)
        self._passed[key] = None
        if len(self._passed) > self._capacity:
            self._passed.popitem(last=False)

    def __len__(self) -> int:
        return len(self._passed)
