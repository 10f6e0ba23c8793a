"""A request's mutable state inside the engine core (owned by the scheduler).

There is no prefill/decode flag: a request has `num_tokens` (prompt + output so far) and
`num_computed_tokens` (whose KV is in the cache); each step computes some of the difference, and a
token is sampled when the two meet.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

from serve_app.block_hash import BlockHash
from serve_app.input_processor import ProcessedRequest
from serve_app.types import FinishReason, SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"  # waiting again, KV dropped, will recompute
    FINISHED = "finished"


@dataclass(eq=False)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_ids: frozenset[int] | None  # any of them ends generation (None: no EOS)
    arrival_time: float
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache at first scheduling
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: FinishReason | None = None
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None
    num_preemptions: int = 0
    # prefix-cache hashes of this request's full blocks, extended as blocks fill up
    block_hashes: list[BlockHash] = field(default_factory=list)
    # root of the hash chain: requests with different salts (tenants) never share cached blocks
    cache_salt: bytes | None = None
    # structured outputs: the request's `GrammarState` (engine/grammar_state.py); it is not scheduled
    # before the grammar has compiled
    grammar: Any = None

    def __post_init__(self) -> None:
        self.eos_token_ids = frozenset(self.eos_token_ids or ())
        self.all_token_ids: list[int] = list(self.prompt_token_ids)

    @classmethod
    def from_processed(cls, processed: ProcessedRequest) -> Request:
        """The engine's state for a request `InputProcessor.process` validated."""
        return cls(request_id=processed.request_id, prompt_token_ids=list(processed.prompt_token_ids),
                   sampling_params=processed.sampling_params, eos_token_ids=processed.eos_token_ids,
                   arrival_time=processed.arrival_time, cache_salt=processed.cache_salt)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status == RequestStatus.FINISHED

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)
