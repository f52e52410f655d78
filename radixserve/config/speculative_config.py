"""SpeculativeConfig: vLLM's `--speculative-config` JSON, parsed and validated once at the edge.

Owns: the accepted methods and knobs and their ranges. Does not know: requests, the tree,
tensors. A request's own `prediction` drafts whether or not this config is set (it needs no
server flag); this config turns on the server-wide sources (n-gram prompt lookup, the radix
tree's continuations).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

from radixserve.config.parsing import ConfigError, json_object_from

METHODS = ("ngram", "radix", "auto")
MAX_SPECULATIVE_TOKENS = 16


@dataclass(frozen=True)
class SpeculativeConfig:
    """vLLM's names: method, num_speculative_tokens, prompt_lookup_max/min.

    `ngram`: prompt lookup in the request's own prompt and output. `radix`: continuations
    stored in the radix tree below the request's position, then a bounded per-namespace index
    of recent outputs. `auto`: every source; the longest confident draft wins.
    """

    method: str = "ngram"
    num_speculative_tokens: int = 4  # the most draft tokens verified per request and step
    prompt_lookup_max: int = 4  # longest n-gram matched
    prompt_lookup_min: int = 2  # shortest n-gram matched
    # Recent outputs kept per cache namespace for `radix` / `auto` (tokens, all outputs).
    recent_output_tokens: int = 65536

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ConfigError(f"speculative_config: unknown method {self.method!r}; supported: "
                              f"{', '.join(METHODS)}")
        for name in ("num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min",
                     "recent_output_tokens"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise ConfigError(f"speculative_config: {name} must be an integer, got "
                                  f"{value!r}")
        if not 1 <= self.num_speculative_tokens <= MAX_SPECULATIVE_TOKENS:
            raise ConfigError(f"speculative_config: num_speculative_tokens must be in [1, "
                              f"{MAX_SPECULATIVE_TOKENS}], got {self.num_speculative_tokens}")
        if self.prompt_lookup_min < 1:
            raise ConfigError("speculative_config: prompt_lookup_min must be >= 1, got "
                              f"{self.prompt_lookup_min}")
        if self.prompt_lookup_max < self.prompt_lookup_min:
            raise ConfigError(f"speculative_config: prompt_lookup_max ({self.prompt_lookup_max}) "
                              f"must be >= prompt_lookup_min ({self.prompt_lookup_min})")
        if self.recent_output_tokens < 0:
            raise ConfigError("speculative_config: recent_output_tokens must be >= 0")

    @classmethod
    def parse(cls, value: str | Mapping[str, Any] | SpeculativeConfig) -> SpeculativeConfig:
        """From the flag's JSON text or the offline API's dict. Raises ConfigError."""
        if isinstance(value, SpeculativeConfig):
            return value
        value = json_object_from(value, "speculative_config")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ConfigError(f"speculative_config: unsupported key {unknown[0]!r}; supported: "
                              f"{', '.join(sorted(known))}")
        if "method" not in value:
            raise ConfigError("speculative_config: 'method' is required (one of "
                              f"{', '.join(METHODS)})")
        return cls(**dict(value))
