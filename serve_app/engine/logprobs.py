"""Log-probabilities of sampled tokens: a pure function of the raw logits and the sampled ids.

They are the model's own distribution (log-softmax of the raw logits, before penalties, temperature
and top-k/top-p), as vLLM returns by default and as HF's logits give for the same model.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SampledLogprobs:
    """One sampled token's log-probability and the `n` most likely tokens (most likely first)."""

    logprob: float
    top_ids: tuple[int, ...]
    top_logprobs: tuple[float, ...]


def sampled_logprobs(
    logits: torch.Tensor,  # [S, V] fp32 raw logits
    token_ids: Sequence[int],  # [S] the sampled ids
    num_top: Sequence[int | None],  # [S] alternatives wanted per row; None: no logprobs for the row
) -> list[SampledLogprobs | None]:
    rows = [i for i, n in enumerate(num_top) if n is not None]
    results: list[SampledLogprobs | None] = [None] * len(token_ids)
    if not rows:
        return results
    index = torch.tensor(rows, dtype=torch.long, device=logits.device)
    logp = logits[index].log_softmax(dim=-1)  # [R, V]
    chosen = logp.gather(1, torch.tensor([[token_ids[i]] for i in rows], device=logits.device)).squeeze(1).tolist()
    k = max(num_top[i] for i in rows)
    top_vals, top_ids = logp.topk(k, dim=-1) if k else (logp[:, :0], logp[:, :0].long())
    top_vals, top_ids = top_vals.tolist(), top_ids.tolist()
    for r, i in enumerate(rows):
        n = num_top[i]
        results[i] = SampledLogprobs(chosen[r], tuple(top_ids[r][:n]), tuple(top_vals[r][:n]))
    return results
