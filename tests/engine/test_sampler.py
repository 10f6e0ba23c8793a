"""Sampler and detokenizer: seeds, top-k/top-p masks, stop strings, UTF-8 boundaries."""

from __future__ import annotations

import math

import pytest
import torch

from serve_app.engine.detokenizer import IncrementalDetokenizer
from serve_app.engine.sampler import apply_top_k_top_p, sample
from serve_app.types import SamplingParams


def test_top_k_keeps_exactly_k_most_likely():
    logits = torch.tensor([[1.0, 5.0, 3.0, 4.0, 2.0]])
    out = apply_top_k_top_p(logits, torch.tensor([2]), torch.tensor([1.0]))
    assert torch.isfinite(out).tolist() == [[False, True, False, True, False]]
    assert out[0, 1] == 5.0 and out[0, 3] == 4.0  # kept logits unchanged


def test_top_p_keeps_smallest_set_reaching_p():
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05]])
    logits = probs.log()
    keep = lambda p: torch.isfinite(apply_top_k_top_p(logits, torch.tensor([4]), torch.tensor([p]))).tolist()[0]  # noqa: E731
    assert keep(0.5) == [True, False, False, False]
    assert keep(0.7) == [True, True, False, False]
    assert keep(0.81) == [True, True, True, False]
    assert keep(1.0) == [True, True, True, True]
    assert keep(0.01) == [True, False, False, False]  # the top token always survives


def test_top_k_and_top_p_per_row():
    logits = torch.tensor([[0.0, 1.0, 2.0, 3.0]] * 2)
    out = apply_top_k_top_p(logits, torch.tensor([1, 4]), torch.tensor([1.0, 1.0]))
    assert torch.isfinite(out).sum(dim=1).tolist() == [1, 4]


def test_seeded_samples_do_not_depend_on_the_batch():
    torch.manual_seed(0)
    logits = torch.randn(4, 1000)
    params = SamplingParams(temperature=1.0, seed=1234)
    gen = torch.Generator().manual_seed(0)
    alone = sample(logits[2:3], [params], [hash((1234, 0))], gen)
    batched = sample(logits, [SamplingParams(temperature=1.0)] * 2 + [params] + [SamplingParams(temperature=1.0)], [None, None, hash((1234, 0)), None], gen)
    assert batched[2] == alone[0]
    other = [sample(logits[2:3], [params], [hash((1234, k))], gen)[0] for k in range(20)]
    assert len(set(other)) > 1  # different steps draw different noise


def test_sampling_follows_the_distribution():
    probs = torch.tensor([0.7, 0.2, 0.1])
    logits = probs.log().expand(3000, 3).contiguous()
    gen = torch.Generator().manual_seed(0)
    tokens = torch.tensor(sample(logits, [SamplingParams(temperature=1.0)] * 3000, [None] * 3000, gen))
    freq = torch.bincount(tokens, minlength=3).float() / 3000
    assert torch.allclose(freq, probs, atol=0.03)


def test_greedy_rows_stay_greedy_in_mixed_batch():
    logits = torch.tensor([[0.0, 9.0, 1.0], [0.0, 0.0, 0.0]])
    gen = torch.Generator().manual_seed(0)
    out = sample(logits, [SamplingParams(temperature=0.0), SamplingParams(temperature=1.0)], [None, None], gen)
    assert out[0] == 1


def test_temperature_sharpens():
    logits = torch.tensor([[2.0, 1.0, 0.0]]).expand(2000, 3).contiguous()
    gen = torch.Generator().manual_seed(0)
    cold = sample(logits, [SamplingParams(temperature=0.1)] * 2000, [None] * 2000, gen)
    assert sum(t == 0 for t in cold) / 2000 > 0.99
    assert math.isclose(sum(t == 0 for t in sample(logits, [SamplingParams(temperature=1.0)] * 2000, [None] * 2000, gen)) / 2000, 0.665, abs_tol=0.04)


@pytest.fixture(scope="module")
def backend_tokenizer(tokenizer):
    return tokenizer.backend_tokenizer


def _stream(tok, text: str, params: SamplingParams) -> tuple[list[str], IncrementalDetokenizer]:
    ids = tok.encode(text, add_special_tokens=False).ids
    detok = IncrementalDetokenizer(tok, params)
    deltas = []
    for i in ids:
        detok.update((i,))
        deltas.append(detok.take_delta(False))
        if detok.stopped:
            break
    deltas.append(detok.take_delta(True))
    return deltas, detok


def test_detokenizer_multibyte_utf8(backend_tokenizer):
    text = "héllo 日本語 wörld 🎉 naïve café"
    deltas, _ = _stream(backend_tokenizer, text, SamplingParams())
    assert "".join(deltas) == text
    assert all("\ufffd" not in d for d in deltas)


def test_stop_string_spanning_tokens_is_excluded(backend_tokenizer):
    text = "The answer is forty-two. END OF ANSWER and more text"
    ids = backend_tokenizer.encode(text, add_special_tokens=False).ids
    stop = "END OF"
    # the stop string really spans several tokens
    assert not any(stop in backend_tokenizer.decode([i]) for i in ids)
    deltas, detok = _stream(backend_tokenizer, text, SamplingParams(stop=(stop,)))
    assert detok.stopped
    assert "".join(deltas) == "The answer is forty-two. "
    # nothing of the stop string was emitted before it was recognised
    partial = ""
    for d in deltas:
        partial += d
        assert "END" not in partial


def test_earliest_of_several_stop_strings_wins(backend_tokenizer):
    deltas, detok = _stream(backend_tokenizer, "alpha beta gamma delta", SamplingParams(stop=("delta", "beta")))
    assert "".join(deltas) == "alpha "
