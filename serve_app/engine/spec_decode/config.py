"""Speculative decoding's configuration (the native engine's `EngineConfig.speculative`, and the vLLM
backend's `speculative` option): a frozen dataclass validated once at construction, `ValueError`
naming the field. Imports no torch."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

from serve_app.validation import require

SPEC_METHODS = ("off", "ngram", "draft")
SPEC_ACCEPTANCE = ("exact", "rejection")


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding: each decoding request may be verified with up to `max_k` proposed tokens
    per step (see docs/speculative_decoding.md).

    `method`: `off`; `ngram` (prompt lookup: the tokens that followed the latest earlier occurrence
    of the last `ngram_min`..`ngram_max` tokens of the prompt and output); or `draft` (a second,
    smaller model, `draft_model`, with the target's vocabulary and its own KV cache of
    `draft_kv_cache_memory_gib`). `k` 0 (the default) picks the number of proposed tokens per request
    and step adaptively, from the request's measured acceptance and the engine's fitted step cost;
    `k` > 0 always proposes that many (fixed k, for comparison).

    `acceptance`: `exact` (default) keeps every output identical to decoding without speculation
    (greedy and seeded sampling); `rejection` (draft only) draws a sampling request's proposals from
    the draft's distribution and verifies them by rejection sampling: more accepted, the same output
    distribution, but a seeded output then depends on what the draft proposed, hence on load.
    """

    method: str = "off"
    max_k: int = 4
    k: int = 0
    ngram_min: int = 2
    ngram_max: int = 4
    draft_model: str = ""
    draft_kv_cache_memory_gib: float = 0.25
    acceptance: str = "exact"

    def __post_init__(self) -> None:
        require(self.method in SPEC_METHODS, "speculative.method", f"must be one of {SPEC_METHODS}, got {self.method!r}")
        for name in ("max_k", "k", "ngram_min", "ngram_max"):
            require(isinstance(getattr(self, name), int) and not isinstance(getattr(self, name), bool),
                     f"speculative.{name}", "must be an integer")
        require(1 <= self.max_k <= 16, "speculative.max_k", f"must be in [1, 16], got {self.max_k}")
        require(0 <= self.k <= self.max_k, "speculative.k", f"must be in [0, max_k] (0: adaptive), got {self.k}")
        require(1 <= self.ngram_min <= self.ngram_max, "speculative.ngram_min", "must be in [1, ngram_max]")
        require(self.acceptance in SPEC_ACCEPTANCE, "speculative.acceptance", f"must be one of {SPEC_ACCEPTANCE}, got {self.acceptance!r}")
        require(self.method == "draft" or self.acceptance == "exact", "speculative.acceptance",
                 "rejection sampling needs proposals drawn from a distribution: method draft")
        require((self.method == "draft") == bool(self.draft_model), "speculative.draft_model",
                 "required with method draft (a model directory), and only then")
        require(isinstance(self.draft_kv_cache_memory_gib, int | float) and self.draft_kv_cache_memory_gib > 0,
                 "speculative.draft_kv_cache_memory_gib", "must be > 0")

    @property
    def enabled(self) -> bool:
        return self.method != "off"

    @classmethod
    def from_value(cls, value: SpeculativeConfig | dict[str, Any] | None) -> SpeculativeConfig:
        """From the `speculative` option: a mapping of these fields (None: off)."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value or cls()
        require(isinstance(value, dict), "speculative", f"must be a mapping such as {{'method': 'ngram'}}, got {value!r}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(value) - known)
        require(not unknown, f"speculative.{unknown[0] if unknown else ''}", f"not a speculative option (known: {', '.join(sorted(known))})")
        if "method" not in value:
            value = {**value, "method": "ngram"}  # a mapping without a method asks for the default one
        return cls(**value)
