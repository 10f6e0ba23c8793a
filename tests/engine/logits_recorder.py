"""Records the fp32 logits an engine computes for every sampled position, keyed by the tokens they
were computed from, so that two runs of the same prompts in different shapes (alone, batched,
chunked, after a prefix-cache hit, preempted, speculated) can be compared position by position."""

from __future__ import annotations

import torch


class LogitsRecorder:
    """Wraps `llm`'s `ModelRunner.sampling_logits`. `rows[tokens]` is the logits row [V] predicting
    the token after `tokens` (the prompt and outputs up to that position). A position computed twice
    (a recompute after preemption) keeps its latest row; `recomputed` counts such rewrites that were
    not bit-identical."""

    def __init__(self, llm) -> None:
        core = llm.engine.core
        runner = core.model_runner
        self.rows: dict[tuple[int, ...], torch.Tensor] = {}
        self.changed_on_recompute = 0
        self.num_verified = 0  # rows that verified a proposed token (speculative decoding)
        original = runner.sampling_logits

        def recorded(scheduled):
            history = {s.request_id: list(core.scheduler.requests[s.request_id].all_token_ids[: s.start_pos]) + list(s.token_ids)
                       for s in scheduled}
            samplers, logits = original(scheduled)
            at = 0
            for s in samplers:
                n = 1 + len(s.spec_token_ids)
                self.num_verified += n - 1
                for j in range(n):
                    key = tuple(history[s.request_id][: s.context_len - n + j + 1])
                    row = logits[at + j].clone()
                    if key in self.rows and not torch.equal(self.rows[key], row):
                        self.changed_on_recompute += 1
                    self.rows[key] = row
                at += n
            return samplers, logits

        runner.sampling_logits = recorded

    def compare(self, other: LogitsRecorder) -> tuple[int, int, float]:
        """(positions both computed, of them bit-identical, largest absolute difference)."""
        common = self.rows.keys() & other.rows.keys()
        same = sum(torch.equal(self.rows[k], other.rows[k]) for k in common)
        worst = max(((self.rows[k] - other.rows[k]).abs().max().item() for k in common), default=0.0)
        return len(common), same, worst

    def topk_agree(self, other: LogitsRecorder, k: int = 5) -> bool:
        """Each side's greedy token at every common position is among the other's top k."""
        for key in self.rows.keys() & other.rows.keys():
            a, b = self.rows[key], other.rows[key]
            if int(a.argmax()) not in b.topk(k).indices.tolist() or int(b.argmax()) not in a.topk(k).indices.tolist():
                return False
        return True
