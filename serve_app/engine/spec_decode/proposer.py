"""Proposers: guess the next tokens of a step's decoding requests, for the target model to verify in
one step.

Contract: `propose(candidates)` returns, per request id, at most the candidate's `max_k` tokens that
might follow its `token_ids` (its prompt and output so far); a request with no good guess is left
out. A proposal without `draft_probs` is a deterministic function of the candidate's tokens, so
verification can keep every output identical to decoding without speculation (`acceptance.accept`);
one with `draft_probs` was sampled from them and is verified by rejection sampling
(`rejection.rejection_sample`). `forget(request_id)` drops what the proposer keeps for a request
(called when it finishes).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from serve_app.types import SamplingParams


@dataclass(frozen=True)
class SpecCandidate:
    """A decoding request that may be verified with up to `max_k` proposed tokens this step."""

    request_id: str
    token_ids: Sequence[int]  # prompt + output so far
    max_k: int
    sampling_params: SamplingParams | None = None
    num_output_tokens: int = 0  # the output index of the token the first proposal stands for is this


@dataclass(frozen=True)
class Proposal:
    token_ids: tuple[int, ...]
    draft_probs: Any = None  # [len(token_ids), V] tensor: the distributions they were drawn from; None: deterministic

    def truncated(self, k: int) -> Proposal:
        if k >= len(self.token_ids):
            return self
        return Proposal(self.token_ids[:k], None if self.draft_probs is None else self.draft_probs[:k])


class Proposer(Protocol):
    # True when every proposal has its candidate's `max_k` tokens and each costs a model pass (a
    # draft model): the adaptive policy then picks k before proposing, not after
    full_length: bool

    def propose(self, candidates: Sequence[SpecCandidate]) -> dict[str, Proposal]: ...

    def forget(self, request_id: str) -> None: ...


class NgramProposer:
    """Prompt lookup: find the latest earlier occurrence of the last n tokens (n from `max_n` down to
    `min_n`) and propose the tokens that followed it. Model-free; it shines where the reply copies
    text from the prompt (quotes, code edits, extraction)."""

    full_length = False

    def __init__(self, min_n: int = 2, max_n: int = 4) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError("ngram_min: must be in [1, ngram_max]")
        self.min_n = min_n
        self.max_n = max_n

    def propose(self, candidates: Sequence[SpecCandidate]) -> dict[str, Proposal]:
        out = {}
        for c in candidates:
            if tokens := self.lookup(c.token_ids, c.max_k):
                out[c.request_id] = Proposal(tuple(tokens))
        return out

    def forget(self, request_id: str) -> None:
        pass  # keeps nothing

    def lookup(self, token_ids: Sequence[int], k: int) -> list[int]:
        """At most `k` tokens that followed the latest earlier match of the sequence's tail."""
        num = len(token_ids)
        if k <= 0 or num < self.min_n + 1:
            return []
        tokens = list(token_ids)
        last = tokens[-1]
        # candidate ends: earlier positions holding the last token, newest first
        ends = [i for i in range(num - 2, -1, -1) if tokens[i] == last]
        for n in range(min(self.max_n, num - 1), self.min_n - 1, -1):
            suffix = tokens[num - n :]
            for end in ends:
                if end + 1 >= n and tokens[end + 1 - n : end + 1] == suffix:
                    return tokens[end + 1 : end + 1 + k]
        return []
