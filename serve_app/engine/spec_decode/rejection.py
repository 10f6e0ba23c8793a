"""Rejection sampling for proposals drawn from a draft model's distribution (acceptance `rejection`).

The draft sampled proposal x_j from q_j; the target's distribution at that position is p_j. Accept
x_j with probability min(1, p_j(x_j) / q_j(x_j)); at the first rejection, draw the position's token
from the residual max(0, p_j - q_j) (normalised) and stop; when every proposal is accepted, draw one
more token from p_k. Each output token is then distributed exactly as the target's (Leviathan et al.,
2023), and more proposals are accepted than under the exact rule (`acceptance.accept`), which only
keeps a proposal equal to the target's own sample: sum_x min(p(x), q(x)) against p(x_j).

What it changes: a seeded request's tokens are reproducible for the same proposals, but the
proposals (and how many a step verifies) depend on load, so the same seed may give another (equally
distributed) output under other traffic. Greedy requests never take this path.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from serve_app.engine.sampler import draw, seeded_generator


def rejection_sample(
    target_probs: torch.Tensor,  # [k + 1, V]: the target's distribution after the last token and after each proposal
    draft_probs: torch.Tensor,  # [k, V]: the draft's distribution each proposal was drawn from
    proposed: Sequence[int],
    accept_keys: Sequence[int | None],  # per proposal: the seeded key of its acceptance draw (None: `generator`)
    sample_keys: Sequence[int | None],  # per position (k + 1): the seeded key of a residual / bonus draw
    generator: torch.Generator,
) -> tuple[int, ...]:
    """The tokens this step produces (1 to k + 1)."""
    k = len(proposed)
    if target_probs.shape[0] != k + 1 or draft_probs.shape[0] != k:
        raise ValueError("target_probs / draft_probs: need k + 1 and k rows for k proposals")
    device = target_probs.device
    for j, token in enumerate(proposed):
        gen = generator if accept_keys[j] is None else seeded_generator(accept_keys[j], device)
        u = float(torch.rand((), generator=gen, device=device))
        p, q = float(target_probs[j, token]), float(draft_probs[j, token])
        if u * q < p:  # u < p / q without dividing by a zero q
            continue
        residual = (target_probs[j] - draft_probs[j]).clamp_(min=0)
        if float(residual.sum()) <= 0:  # p == q up to rounding: any token p allows is right
            residual = target_probs[j]
        token_j = int(draw(residual.unsqueeze(0), [sample_keys[j]], generator)[0])
        return (*proposed[:j], token_j)
    bonus = int(draw(target_probs[k : k + 1], [sample_keys[k]], generator)[0])
    return (*proposed, bonus)
