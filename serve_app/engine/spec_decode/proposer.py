"""Proposers: guess the next tokens of a request cheaply, for the target model to verify in one step.

Contract: `propose(token_ids, k)` returns at most `k` token ids that might follow `token_ids` (the
request's prompt and output so far); fewer (or none) when it has no good guess. A proposal is a
deterministic function of `token_ids`, so verification can keep every output identical to decoding
without speculation (see `acceptance.accept`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol


class Proposer(Protocol):
    def propose(self, token_ids: Sequence[int], k: int) -> list[int]: ...


class NgramProposer:
    """Prompt lookup: find the latest earlier occurrence of the last n tokens (n from `max_n` down to
    `min_n`) and propose the tokens that followed it. Model-free; it shines where the reply copies
    text from the prompt (quotes, code edits, extraction)."""

    def __init__(self, min_n: int = 2, max_n: int = 4) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError("ngram_min: must be in [1, ngram_max]")
        self.min_n = min_n
        self.max_n = max_n

    def propose(self, token_ids: Sequence[int], k: int) -> list[int]:
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
