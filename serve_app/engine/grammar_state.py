"""One request's grammar matcher: which tokens its grammar allows next, advanced by each accepted token.

The scheduler owns it (on the `Request`): the request waits, outside the running batch, until its
grammar has compiled (`poll`); `accept` advances it by each token the request keeps, so after a
preemption (whose recompute keeps the output) the matcher is still where the output is. The model
runner fills the request's bitmask rows while the forward pass runs (`fill_rows`), one row per
sampled position: for a verification with proposed tokens, row j is the mask after proposals
0..j-1 (advanced, then rolled back). A proposal the grammar forbids cannot equal the masked sample
of its row, so it is rejected there, and the rows after it are never used.

Once the grammar is complete only the request's EOS tokens are allowed; accepting one terminates
the matcher (the scheduler finishes the request with "stop", even with ignore_eos).
"""

from __future__ import annotations

from concurrent.futures import Future
from typing import Any

import torch

from serve_app.engine.grammar import library_message


class GrammarState:
    def __init__(self, compiled: Future, eos_token_ids: frozenset[int]) -> None:
        self.compiled = compiled
        self.eos_token_ids = sorted(eos_token_ids)
        self.matcher: Any = None

    @property
    def ready(self) -> bool:
        return self.matcher is not None

    def poll(self) -> str | None:
        """Make the matcher once the grammar has compiled; returns the compile error's message if it
        failed (the request must then be aborted), else None (ready, or still compiling)."""
        if self.matcher is not None or not self.compiled.done():
            return None
        exc = self.compiled.exception()
        if exc is not None:
            return f"structured: the grammar failed to compile: {library_message(exc)}"
        import xgrammar as xgr

        self.matcher = xgr.GrammarMatcher(self.compiled.result(), override_stop_tokens=self.eos_token_ids or None)
        return None

    @property
    def terminated(self) -> bool:
        return self.matcher is not None and self.matcher.is_terminated()

    def accept(self, token_id: int) -> bool:
        """Advance by a kept token; False if the grammar does not allow it (a bug upstream)."""
        return bool(self.matcher.accept_token(token_id))

    def fill_rows(self, bitmask: torch.Tensor, first_row: int, draft_token_ids: tuple[int, ...]) -> None:
        """Fill rows `first_row .. first_row + len(draft_token_ids)` of `bitmask` ([R, ceil(V/32)] int32,
        which comes with every bit set) and leave the matcher as it was. Rows past a forbidden or an
        EOS proposal are left as they came: they are never used."""
        matcher = self.matcher
        matcher.fill_next_token_bitmask(bitmask, first_row)
        advanced = 0
        for j, token_id in enumerate(draft_token_ids):
            if not matcher.accept_token(token_id):  # forbidden: rejected at row first_row + j
                break
            advanced += 1
            if matcher.is_terminated():  # an accepted EOS proposal: the request stops there
                break
            matcher.fill_next_token_bitmask(bitmask, first_row + j + 1)
        if advanced:
            matcher.rollback(advanced)
