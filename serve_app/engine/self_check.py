"""The model runner's start-up self-check: do the paths it selected on this CPU keep their contract?

A short fixed prompt runs through the selected paths several ways: whole, in two chunks (as after a
prefix-cache hit), beside another prompt, and then one decode step alone and beside another decode.
Where the paths claim batch invariance every way must give bit-identical logits; in every case the
selected paths' greedy tokens must be among the reference path's top 5 (torch's F.linear and SDPA
over the weights as loaded, run before anything was packed): the closeness vLLM's model tests ask.
A user on a CPU that no one has tested gets either the contract or a logged fallback, never silently
different answers.

The check uses the first blocks of the KV cache before the engine serves anything; it never touches
the block manager, so no block is left allocated or cached.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from serve_app.engine.outputs import ScheduledRequest
from serve_app.types import SamplingParams

PROMPT_LEN = 40  # tokens (fewer where the KV cache holds less): with blocks of 16, two full and a part one
MIN_PROMPT_LEN = 4
TOP_K = 5

_GREEDY = SamplingParams(temperature=0.0, max_tokens=1)


@dataclass(frozen=True)
class CheckLogits:
    """Last-position logits [V] of each way of computing the check prompt, then of its first decode step."""

    whole: torch.Tensor
    chunked: torch.Tensor
    batched: torch.Tensor
    decode_alone: torch.Tensor
    decode_batched: torch.Tensor


def check_prompt_len(num_blocks: int, block_size: int) -> int:
    """The check prompts' length: `PROMPT_LEN`, or what half the KV cache holds with a decoded token
    (0 when that is under `MIN_PROMPT_LEN`: no check)."""
    length = min(PROMPT_LEN, num_blocks // 2 * block_size - 1)
    return length if length >= MIN_PROMPT_LEN else 0


def check_prompts(vocab_size: int, length: int) -> tuple[list[int], list[int]]:
    """Two fixed prompts of `length` token ids (the same on every machine)."""
    gen = torch.Generator().manual_seed(1234)
    low = min(100, vocab_size // 2)
    ids = torch.randint(low, vocab_size, (2, length), generator=gen).tolist()
    return ids[0], ids[1]


def _request(rid: str, tokens: list[int], start: int, table: tuple[int, ...], sample: bool, prompt: bool) -> ScheduledRequest:
    return ScheduledRequest(rid, tuple(tokens), start, table, sample, prompt, _GREEDY, None)


def run_check(runner, length: int) -> CheckLogits:
    """Compute the check prompt's logits every way through `runner.sampling_logits` (whatever paths
    the runner has now), over KV blocks 0 .. 2n-1 (n blocks per prompt of `length` tokens)."""
    a, b = check_prompts(runner.args.vocab_size, length)
    split = length * 4 // 5  # the "cached prefix" of the chunked run
    n = -(-(length + 1) // runner.block_size)
    table_a, table_b = tuple(range(n)), tuple(range(n, 2 * n))

    def last(scheduled: list[ScheduledRequest], rid: str = "a") -> torch.Tensor:
        samplers, logits = runner.sampling_logits(scheduled)
        return logits[[s.request_id for s in samplers].index(rid)].clone()

    whole = last([_request("a", a, 0, table_a, True, True)])
    next_token = int(whole.argmax())
    decode_alone = last([_request("a", [next_token], length, table_a, True, False)])
    runner.sampling_logits([_request("a", a[:split], 0, table_a, False, True)])
    chunked = last([_request("a", a[split:], split, table_a, True, True)])
    batched = last([_request("b", b, 0, table_b, True, True), _request("a", a, 0, table_a, True, True)])
    decode_batched = last([_request("b", [int(b[0])], length, table_b, True, False),
                           _request("a", [next_token], length, table_a, True, False)])
    return CheckLogits(whole, chunked, batched, decode_alone, decode_batched)


def verdict(selected: CheckLogits, reference: CheckLogits | None, claims_invariance: bool) -> str | None:
    """None when the selected paths keep their contract, else why not."""
    if claims_invariance:
        for name in ("chunked", "batched"):
            if not torch.equal(getattr(selected, name), selected.whole):
                return f"the prompt computed {name} differs from the prompt computed whole"
        if not torch.equal(selected.decode_batched, selected.decode_alone):
            return "a decode step beside another differs from the same step alone"
    if reference is not None:
        for name in ("whole", "decode_alone"):
            got, ref = getattr(selected, name), getattr(reference, name)
            k = min(TOP_K, ref.numel())  # test models may have fewer tokens than TOP_K
            if int(got.argmax()) not in ref.topk(k).indices.tolist() or int(ref.argmax()) not in got.topk(k).indices.tolist():
                return f"the {name.replace('_', ' ')} greedy token is not among the reference path's top {TOP_K}"
    return None
