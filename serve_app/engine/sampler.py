"""Batched token sampling: pure functions over a logits matrix and per-row parameters.

Sampling uses the exponential race: argmax(probs / E) with E ~ Exp(1) draws from `probs`. Each
row's noise comes from its own generator when the request has a seed (keyed by seed and output
index, so its samples do not depend on the batch it shares), else from the engine's generator.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from serve_app.types import SamplingParams


def apply_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Mask logits outside each row's top-k and nucleus (top-p) sets with -inf.

    logits: [S, V] float; top_k: [S] long (V = disabled); top_p: [S] float (1.0 = disabled).
    The most likely token always survives.
    """
    sorted_logits, order = logits.sort(dim=-1, descending=True)  # [S, V]
    vocab = logits.shape[-1]
    ranks = torch.arange(vocab, device=logits.device).expand_as(sorted_logits)
    drop = ranks >= top_k.unsqueeze(1)
    probs = sorted_logits.masked_fill(drop, float("-inf")).softmax(dim=-1)
    # drop a token when the tokens ranked above it already reach top_p
    drop |= (probs.cumsum(dim=-1) - probs) >= top_p.unsqueeze(1)
    drop[:, 0] = False
    return logits.scatter(1, order, sorted_logits.masked_fill(drop, float("-inf")))


def sampling_probs(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """The distribution each row samples from: softmax of the logits over the row's temperature,
    within its top-k / top-p set ([S, V]; greedy rows at temperature 1)."""
    device = logits.device
    vocab = logits.shape[-1]
    temps = torch.tensor([p.temperature if p.temperature > 0 else 1.0 for p in params], device=device)
    logits = logits / temps.unsqueeze(1)
    if any(p.top_k > 0 or p.top_p < 1.0 for p in params):
        top_k = torch.tensor([min(p.top_k, vocab) if p.top_k > 0 else vocab for p in params], device=device)  # fits a long
        top_p = torch.tensor([p.top_p for p in params], device=device)
        logits = apply_top_k_top_p(logits, top_k, top_p)
    return logits.softmax(dim=-1)


TARGET_DRAW, DRAFT_DRAW, ACCEPT_DRAW = 0, 1, 2  # the independent draws a seeded request makes per output position


def draw_key(seed: int, output_index: int, kind: int = TARGET_DRAW) -> int:
    """The key of a seeded request's draw for its `output_index`-th token: the target's sample, the
    draft model's proposal, or a rejection-sampling acceptance test. Python's hash of a tuple of
    ints is the same in every process (no hash randomisation for ints)."""
    return hash((seed, output_index)) if kind == TARGET_DRAW else hash((seed, output_index, kind))


def seeded_generator(key: int, device: torch.device) -> torch.Generator:
    """The generator of one seeded draw (keys come from a request's seed and the draw's position)."""
    return torch.Generator(device=device).manual_seed(key & 0x7FFF_FFFF_FFFF_FFFF)


def draw(probs: torch.Tensor, generator_keys: Sequence[int | None], generator: torch.Generator) -> torch.Tensor:
    """One token per row of `probs` ([S, V]) by the exponential race; a row with a key draws its
    noise from that key's generator, the others from `generator`."""
    noise = torch.empty_like(probs).exponential_(generator=generator)
    for row, key in enumerate(generator_keys):
        if key is not None:
            noise[row].exponential_(generator=seeded_generator(key, probs.device))
    return (probs / noise).argmax(dim=-1)


def sample(
    logits: torch.Tensor,  # [S, V] fp32
    params: Sequence[SamplingParams],
    generator_keys: Sequence[int | None],
    generator: torch.Generator,
    argmax: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> list[int]:
    """One next-token id per row. `argmax`: a faster equivalent of `argmax(dim=-1)` for contiguous
    fp32 logits (the CPU op), used when given."""
    greedy_ids = argmax(logits) if argmax is not None and logits.is_contiguous() else logits.argmax(dim=-1)
    if all(p.greedy for p in params):
        return greedy_ids.tolist()
    keys = [None if p.greedy else key for p, key in zip(params, generator_keys, strict=True)]
    sampled = draw(sampling_probs(logits, params), keys, generator)
    greedy_rows = torch.tensor([p.greedy for p in params], device=logits.device)
    return torch.where(greedy_rows, greedy_ids, sampled).tolist()
