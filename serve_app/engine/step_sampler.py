"""A step's sampling hand-off: from its forward pass to the `ModelRunnerOutput`.

- `sampled_rows`: which rows of the step's flattened batch sample (the lm_head sees only those): each
  sampling request's last token and, for a request verified with proposed tokens, each proposal,
  `1 + len(spec_token_ids)` consecutive rows per request.
- `sample_step`: samples those rows, the whole step in one batch; if that raises, again one request at
  a time, so that only the requests whose own sampling fails are reported (`failed`; the core aborts
  them) and the others keep this step's tokens.
- `drop_requests`: the rows of the requests that stay, once others were dropped (a grammar bitmask
  that could not be filled).

A verified request keeps its samples up to the first one that differs from its proposal
(`spec_decode.acceptance.accept`), or, for proposals sampled from a draft model's distribution, what
rejection sampling accepts (`spec_decode.rejection`). Logprobs are of the logits as handed in (a
constrained request's forbidden tokens already at -inf), before penalties and temperature.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Container, Sequence
from dataclasses import dataclass

import torch

from serve_app.engine.logits_masks import apply_logit_bias
from serve_app.engine.logprobs import sampled_logprobs
from serve_app.engine.outputs import ModelRunnerOutput, ScheduledRequest
from serve_app.engine.penalties import process_logits
from serve_app.engine.sampler import sample, sampling_probs
from serve_app.engine.spec_decode.acceptance import accept
from serve_app.engine.spec_decode.rejection import rejection_sample
from serve_app.faults import FaultHook, Stage

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class SamplingContext:
    """What sampling uses besides the logits: the runner's generator (unseeded rows), the row
    argmax of the runner's paths (None: torch's) and, in tests, a fault hook."""

    generator: torch.Generator
    argmax: Callable | None = None
    fault_hook: FaultHook | None = None


def _num_rows(s: ScheduledRequest) -> int:
    return 1 + len(s.spec_token_ids)  # the last token and each proposed one predict a token


def sampled_rows(scheduled: Sequence[ScheduledRequest]) -> tuple[list[ScheduledRequest], list[int]]:
    """The requests that sample, in `scheduled`'s order, and the rows they sample in the step's
    flattened batch (`scheduled` in row order; increasing)."""
    samplers, rows = [], []
    end = 0
    for s in scheduled:
        end += s.num_tokens
        if s.sample:
            rows.extend(range(end - _num_rows(s), end))
            samplers.append(s)
    return samplers, rows


def take_rows(x: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """`x[rows]` for increasing `rows`; `x` itself when they are all of its rows (no index tensor to
    send to the device)."""
    return x if len(rows) == x.shape[0] else x[torch.tensor(rows, dtype=torch.long, device=x.device)]


def drop_requests(samplers: list[ScheduledRequest], logits: torch.Tensor,
                  dropped: Container[str]) -> tuple[list[ScheduledRequest], torch.Tensor]:
    """The samplers whose request id is not in `dropped`, with their logits rows."""
    keep, rows, at = [], [], 0
    for s in samplers:
        n = _num_rows(s)
        if s.request_id not in dropped:
            keep.append(s)
            rows.extend(range(at, at + n))
        at += n
    return keep, take_rows(logits, rows)


def sample_step(samplers: list[ScheduledRequest], logits: torch.Tensor, ctx: SamplingContext) -> ModelRunnerOutput:
    """`sample_batch`; if it raises, `sample_each`."""
    try:
        return sample_batch(samplers, logits, ctx)
    except Exception:  # noqa: BLE001 - find whose sampling fails: only that request is aborted
        logger.warning("batched sampling failed; sampling the step's %d requests one by one", len(samplers), exc_info=True)
        return sample_each(samplers, logits, ctx)


def sample_each(samplers: list[ScheduledRequest], logits: torch.Tensor, ctx: SamplingContext) -> ModelRunnerOutput:
    """`sample_batch` one request at a time; the requests whose sampling raises are reported in `failed`."""
    outs: list[ModelRunnerOutput] = []
    failed: list[tuple[str, str]] = []
    at = 0
    for s in samplers:
        n = _num_rows(s)
        try:
            outs.append(sample_batch([s], logits[at : at + n], ctx))
        except Exception as exc:  # noqa: BLE001 - this request's own fault
            logger.exception("sampling failed for request %s; it is aborted", s.request_id)
            failed.append((s.request_id, f"{type(exc).__name__}: {exc}"))
        at += n
    any_logprobs = any(o.logprobs for o in outs)
    any_extra = any(o.extra_token_ids for o in outs)
    return ModelRunnerOutput(
        tuple(o.request_ids[0] for o in outs), tuple(o.sampled_token_ids[0] for o in outs),
        tuple(o.logprobs[0] if o.logprobs else None for o in outs) if any_logprobs else (),
        extra_token_ids=tuple(o.extra_token_ids[0] if o.extra_token_ids else () for o in outs) if any_extra else (),
        failed=tuple(failed))


def sample_batch(samplers: list[ScheduledRequest], logits: torch.Tensor, ctx: SamplingContext) -> ModelRunnerOutput:
    """Sample (and verify proposals for) `samplers` from their logits rows ([rows, V], `sampled_rows`)."""
    if ctx.fault_hook is not None:
        for s in samplers:
            ctx.fault_hook.check(Stage.SAMPLE, s.request_id)
    # one row per sampled position; a verified request's rows carry no penalties, min_tokens or
    # logprobs (`SamplingParams.can_speculate`), so the per-request inputs repeat unchanged
    spans = [_num_rows(s) for s in samplers]

    def per_row(values: list) -> list:
        return [v for v, n in zip(values, spans, strict=True) for _ in range(n)]

    params = per_row([s.sampling_params for s in samplers])
    keys = [key for s in samplers for key in (s.generator_key, *s.spec_generator_keys)]
    processed = process_logits(logits, params, per_row([s.prompt_token_ids for s in samplers]),
                               per_row([s.output_token_ids for s in samplers]), per_row([s.blocked_token_ids for s in samplers]))
    processed = apply_logit_bias(processed, params)
    token_ids = sample(processed, params, keys, ctx.generator, ctx.argmax)
    row_logprobs = ()
    if any(p.logprobs is not None for p in params):
        row_logprobs = tuple(sampled_logprobs(logits, token_ids, [p.logprobs for p in params]))
    request_ids = tuple(s.request_id for s in samplers)
    if len(token_ids) == len(samplers):
        return ModelRunnerOutput(request_ids, tuple(token_ids), row_logprobs)
    accepted, logprobs, at = [], [], 0
    for s, n in zip(samplers, spans, strict=True):
        if s.spec_draft_probs is None:
            accepted.append(accept(token_ids[at : at + n], s.spec_token_ids))
        else:
            target = sampling_probs(processed[at : at + n], params[at : at + n])
            accepted.append(rejection_sample(target, s.spec_draft_probs.to(target.device, target.dtype), s.spec_token_ids,
                                             s.spec_accept_keys, keys[at : at + n], ctx.generator))
        logprobs.append(row_logprobs[at] if row_logprobs else None)
        at += n
    return ModelRunnerOutput(request_ids, tuple(a[0] for a in accepted), tuple(logprobs) if row_logprobs else (),
                             extra_token_ids=tuple(a[1:] for a in accepted))
