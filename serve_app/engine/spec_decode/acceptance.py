"""The acceptance rule for deterministic proposals.

At each of the k + 1 positions of a verified request the engine samples the target model's token
exactly as it would without speculation (same logits processing, the same per-position random draw
for seeded requests); a proposed token is accepted only if it equals that sample. The accepted
tokens are therefore the very tokens decoding without speculation would have produced, one per
step: outputs are identical (greedy and seeded), and the distribution is the target's.
"""

from __future__ import annotations

from collections.abc import Sequence


def accept(sampled: Sequence[int], proposed: Sequence[int]) -> tuple[int, ...]:
    """Tokens this step produces: the target's samples up to and including the first one that
    differs from its proposal (all k + 1 when every proposal matched).

    sampled: the k + 1 target tokens (after the last known token, then after each proposal);
    proposed: the k proposed tokens.
    """
    if len(sampled) != len(proposed) + 1:
        raise ValueError("sampled: need one more token than proposed")
    for j, token in enumerate(proposed):
        if sampled[j] != token:
            return tuple(sampled[: j + 1])
    return tuple(sampled)
