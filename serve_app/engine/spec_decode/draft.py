"""Draft-model proposer: a second (smaller) model with its own paged KV cache runs ahead of the target.

Per engine step it catches each candidate up on the tokens it has not read yet (the whole prompt the
first time; afterwards the tokens accepted since, in one chunk with the first proposal's forward
pass), then decodes `max_k - 1` more positions, all candidates batched in each forward pass. Its
cache keeps, per request, the KV of the tokens it has read; proposals the target rejected are
dropped by trimming back to the longest prefix it shares with the request's real tokens, so the
draft never recomputes what it already holds.

Acceptance `exact` (default): proposals are the draft's greedy continuation, a deterministic function
of the request's tokens, verified by the exact rule: outputs are identical to decoding without
speculation, greedy or seeded. Acceptance `rejection`: a sampling request's proposals are drawn
from the draft's own distribution (the request's temperature / top-k / top-p) and verified by
rejection sampling (`spec_decode.rejection`), which accepts more but changes which promise holds:
see that module. Greedy requests keep the exact rule either way.

When the draft cache is full, the draft state of requests not proposing this step is dropped first;
a candidate that still does not fit gets no proposal.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from serve_app.engine.block_manager import BlockManager
from serve_app.engine.config import CacheConfig, EngineConfig, ModelConfig
from serve_app.engine.model_runner import ModelRunner
from serve_app.engine.outputs import ScheduledRequest
from serve_app.engine.request import Request
from serve_app.engine.sampler import DRAFT_DRAW, draw, draw_key, sampling_probs
from serve_app.engine.spec_decode.proposer import Proposal, SpecCandidate
from serve_app.types import SamplingParams


@dataclass
class _Drafting:
    """One candidate's proposals in progress."""

    candidate: SpecCandidate
    seq: Request  # the draft's view: `all_token_ids` are the tokens whose KV its cache holds
    feed: list[int]  # tokens to read in the next forward pass
    tokens: list[int] = field(default_factory=list)
    probs: list[torch.Tensor] = field(default_factory=list)


class DraftProposer:
    full_length = True  # max_k tokens for every candidate, one draft forward pass per position

    def __init__(self, runner: ModelRunner, sample_from_draft: bool, seed: int = 0) -> None:
        self.runner = runner
        self.blocks = BlockManager(runner.num_blocks, runner.block_size, enable_prefix_caching=False)
        self.sample_from_draft = sample_from_draft
        self.generator = torch.Generator(device=runner.device).manual_seed(seed + 1)
        self._seqs: dict[str, Request] = {}  # by request id, least recently proposed for first

    @classmethod
    def build(cls, config: EngineConfig, vocab_size: int) -> DraftProposer:
        """The draft's model runner: same dtype, device, attention backend and block size as the
        target's; its own KV cache of `speculative.draft_kv_cache_memory_gib`."""
        spec, model = config.speculative, config.model
        draft_model = ModelConfig(model=spec.draft_model, dtype=model.dtype, device=model.device, seed=model.seed,
                                  attention_backend=model.attention_backend, enforce_eager=model.enforce_eager)
        try:
            hf_config = draft_model.hf_config()
        except ValueError as exc:
            raise ValueError(f"speculative.draft_model: {exc}") from exc
        if hf_config.get("vocab_size") != vocab_size:
            raise ValueError(f"speculative.draft_model: its vocabulary ({hf_config.get('vocab_size')} tokens) is not the "
                             f"target model's ({vocab_size}); proposals must be the target's token ids")
        cache = CacheConfig(block_size=config.cache.block_size, kv_cache_memory_gib=spec.draft_kv_cache_memory_gib,
                            enable_prefix_caching=False)
        return cls(ModelRunner(draft_model, cache, hf_config, config.scheduler), spec.acceptance == "rejection", model.seed)

    def forget(self, request_id: str) -> None:
        self._seqs.pop(request_id, None)
        self.blocks.free(request_id)

    def propose(self, candidates: Sequence[SpecCandidate]) -> dict[str, Proposal]:
        keep = {c.request_id for c in candidates}
        work = [d for c in candidates if (d := self._start(c, keep)) is not None]
        for position in range(max((d.candidate.max_k for d in work), default=0)):
            active = [d for d in work if position < d.candidate.max_k]
            scheduled = [ScheduledRequest(d.seq.request_id, tuple(d.feed), d.seq.num_computed_tokens,
                                          tuple(self.blocks.block_table(d.seq.request_id)), sample=True,
                                          reads_prompt=len(d.feed) > 1, sampling_params=d.candidate.sampling_params or SamplingParams(),
                                          generator_key=None) for d in active]
            samplers, logits = self.runner.sampling_logits(scheduled)
            by_id = {d.seq.request_id: d for d in active}
            for s, row in zip(samplers, logits, strict=True):
                d = by_id[s.request_id]
                d.seq.all_token_ids.extend(d.feed)
                d.seq.num_computed_tokens += len(d.feed)
                token = self._pick(d, row, position)
                d.tokens.append(token)
                d.feed = [token]
        return {d.candidate.request_id: Proposal(tuple(d.tokens), torch.stack(d.probs) if d.probs else None)
                for d in work if d.tokens}

    def _start(self, candidate: SpecCandidate, keep: set[str]) -> _Drafting | None:
        """Trim the draft's state of this request to what it shares with the request's tokens, and
        reserve slots for the tokens to read and the proposals to feed back (all but the last)."""
        rid, tokens = candidate.request_id, list(candidate.token_ids)
        seq = self._seqs.pop(rid, None)
        if seq is None:
            seq = Request(rid, [], SamplingParams(), None, 0.0)
        self._seqs[rid] = seq  # most recently used last
        shared = 0
        limit = min(len(seq.all_token_ids), len(tokens) - 1)  # read at least the newest token again
        while shared < limit and seq.all_token_ids[shared] == tokens[shared]:
            shared += 1
        self.blocks.trim(rid, shared)
        del seq.all_token_ids[shared:]
        seq.num_computed_tokens = shared
        num_new = len(tokens) - shared + candidate.max_k - 1
        if not self._allocate(seq, num_new, keep):
            return None
        return _Drafting(candidate, seq, tokens[shared:])

    def _allocate(self, seq: Request, num_new: int, keep: set[str]) -> bool:
        while not self.blocks.allocate_slots(seq, num_new):
            victim = next((rid for rid in self._seqs if rid not in keep), None)
            if victim is None:
                return False
            self.forget(victim)
        return True

    def _pick(self, d: _Drafting, logits: torch.Tensor, position: int) -> int:
        params = d.candidate.sampling_params or SamplingParams(temperature=0.0)
        if not self.sample_from_draft or params.greedy:
            return int(logits.argmax())
        probs = sampling_probs(logits.unsqueeze(0).float(), [params])
        key = None if params.seed is None else draw_key(params.seed, d.candidate.num_output_tokens + position, DRAFT_DRAW)
        d.probs.append(probs[0])
        return int(draw(probs, [key], self.generator)[0])
