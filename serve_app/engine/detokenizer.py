"""Incremental detokenization with stop strings.

`tokenizers`' DecodeStream turns token ids into text chunks only once they form whole UTF-8
characters (a multi-byte character split across tokens waits for its last byte). On top of it this
class finds stop strings, even when one spans several tokens, and holds back the last
`max(len(stop)) - 1` characters while generation goes on, so a stop string is never half-emitted.
"""

from __future__ import annotations

from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream

from serve_app.types import SamplingParams


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Tokenizer, params: SamplingParams) -> None:
        self._tokenizer = tokenizer
        self._stream = DecodeStream(skip_special_tokens=params.skip_special_tokens)
        self._stops = params.stop
        self._hold = max((len(s) for s in self._stops), default=1) - 1
        self.text = ""  # all text so far (truncated at the stop string once one is found)
        self._emitted = 0
        self.stopped = False

    def update(self, token_ids: tuple[int, ...]) -> int:
        """Add tokens; sets `stopped` (and truncates `text`) when a stop string appears. Returns how
        many of the tokens were taken: all of them, or up to the one that completed a stop string
        (a step that accepted several speculative tokens may run past it)."""
        for i, token_id in enumerate(token_ids):
            if self.stopped:
                return i
            chunk = self._stream.step(self._tokenizer, token_id)
            if not chunk:
                continue
            search_from = max(0, len(self.text) - self._hold)
            self.text += chunk
            hits = [at for at in (self.text.find(stop, search_from) for stop in self._stops) if at != -1]
            if hits:
                self.text = self.text[: min(hits)]
                self.stopped = True
        return len(token_ids)

    def take_delta(self, finished: bool) -> str:
        """Text not returned yet; while unfinished, minus the tail that could begin a stop string."""
        end = len(self.text) if finished or not self._stops else max(self._emitted, len(self.text) - self._hold)
        delta = self.text[self._emitted : end]
        self._emitted = end
        return delta
