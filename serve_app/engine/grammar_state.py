"""One request's grammar matcher: which tokens its grammar allows next, advanced by each accepted token.

The scheduler owns it (on the `Request`): the request waits, outside the running batch, until its
grammar has compiled (`poll`); `accept` advances it by each token the request keeps, so after a
preemption (whose recompute keeps the output) the matcher is still where the output is. The model
runner's masks (`logits_masks`) ask it which tokens are allowed at each sampled row, advancing it
over a verification's proposed tokens and rolling it back, so that it is left where it was.

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
        """Advance by a token; False (and not advanced) if the grammar does not allow it."""
        return bool(self.matcher.accept_token(token_id))

    def allows(self, token_id: int) -> bool:
        """Whether the grammar allows `token_id` next (the matcher is left as it was): a few
        microseconds, where filling the whole mask can take a hundred or more."""
        if not self.matcher.accept_token(token_id):
            return False
        self.matcher.rollback(1)
        return True

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the allowed next tokens into row `row` of `bitmask` ([R, ceil(V/32)] int32, CPU)."""
        self.matcher.fill_next_token_bitmask(bitmask, row)

    def rollback(self, num_tokens: int) -> None:
        """Undo the last `num_tokens` `accept`s."""
        self.matcher.rollback(num_tokens)
