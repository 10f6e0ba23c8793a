"""Logits processors applied before sampling: pure functions of a logits matrix and per-row state.

Each row is one sampled position of one request; a sampler that samples several positions of a
request (speculative decoding) passes one row per position, each with the tokens before it.

- `repetition_penalty` (HF's `RepetitionPenaltyLogitsProcessor`, as vLLM): every token seen in the
  prompt or the output has its logit divided by the penalty when positive, multiplied when negative.
- `presence_penalty` / `frequency_penalty` (OpenAI's formula, over output tokens only):
  `logit -= frequency_penalty * count + presence_penalty * (count > 0)`.
- `min_tokens`: the row's `blocked_token_ids` (EOS and stop token ids while the output is shorter
  than `min_tokens`) get -inf, so they cannot be sampled (nor chosen greedily).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from serve_app.types import SamplingParams


def apply_penalties(
    logits: torch.Tensor,  # [V] fp32, one row
    params: SamplingParams,
    prompt_token_ids: Sequence[int],
    output_token_ids: Sequence[int],
) -> torch.Tensor:
    """The row with `params`' repetition, presence and frequency penalties applied (a new tensor)."""
    vocab = logits.shape[-1]
    out = logits.clone()
    if params.repetition_penalty != 1.0:
        seen = torch.tensor(sorted(set(prompt_token_ids) | set(output_token_ids)), dtype=torch.long, device=logits.device)
        if seen.numel():
            vals = out[seen]
            out[seen] = torch.where(vals > 0, vals / params.repetition_penalty, vals * params.repetition_penalty)
    if (params.presence_penalty or params.frequency_penalty) and output_token_ids:
        counts = torch.bincount(torch.tensor(output_token_ids, dtype=torch.long, device=logits.device), minlength=vocab)[:vocab]
        out -= params.frequency_penalty * counts + params.presence_penalty * (counts > 0)
    return out


def block_tokens(logits: torch.Tensor, blocked_token_ids: Sequence[Sequence[int]]) -> torch.Tensor:
    """logits [S, V] with each row's blocked token ids set to -inf (in place; returns it)."""
    for row, ids in enumerate(blocked_token_ids):
        if ids:
            logits[row, torch.tensor(list(ids), dtype=torch.long, device=logits.device)] = float("-inf")
    return logits


def process_logits(
    logits: torch.Tensor,  # [S, V] fp32
    params: Sequence[SamplingParams],
    prompt_token_ids: Sequence[Sequence[int]],
    output_token_ids: Sequence[Sequence[int]],
    blocked_token_ids: Sequence[Sequence[int]],
) -> torch.Tensor:
    """Penalties, then blocked tokens, per row; returns `logits` itself when no row needs either."""
    if not any(p.has_penalties for p in params) and not any(blocked_token_ids):
        return logits
    out = logits.clone()
    for row, p in enumerate(params):
        if p.has_penalties:
            out[row] = apply_penalties(logits[row], p, prompt_token_ids[row], output_token_ids[row])
    return block_tokens(out, blocked_token_ids)
