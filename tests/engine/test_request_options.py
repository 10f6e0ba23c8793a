"""Per-request options against references, on a Llama-3-style random-weight checkpoint (fp32):
logprobs / top logprobs vs HF's logits; repetition penalty vs HF's RepetitionPenaltyLogitsProcessor
(and HF generate); presence / frequency penalties vs OpenAI's documented formula; min_tokens vs HF's
min_new_tokens; stop_token_ids."""

from __future__ import annotations

import math

import pytest
import torch

from serve_app.engine import LLM, SamplingParams
from serve_app.engine.penalties import apply_penalties, process_logits
from tests.engine import tiny_checkpoints as tc

PROMPTS = [[tc.BOS, 20, 21, 22, 23], [tc.BOS, 100, 7, 7, 7, 50, 60], [tc.BOS, 9]]
N = 16


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    model = tc.build(tc.llama3_config())
    path = tc.save(model, tmp_path_factory.mktemp("llama3"), add_bos=True)
    llm = LLM(path, dtype="float32", block_size=8, num_blocks=64)
    return model, llm


def hf_logits(model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float()  # [T, V]


def hf_generate(model, ids: list[int], n: int, **kwargs) -> list[int]:
    x = torch.tensor([ids])
    with torch.no_grad():
        out = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=n, do_sample=False,
                             pad_token_id=tc.END_OF_TEXT, **kwargs)
    return out[0, len(ids):].tolist()


# ---- logprobs ------------------------------------------------------------------------------------


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_logprobs_match_hf_logits(tiny, temperature):
    model, llm = tiny
    params = SamplingParams(temperature=temperature, seed=1, max_tokens=N, ignore_eos=True, logprobs=5)
    for prompt, out in zip(PROMPTS, llm.generate(PROMPTS, params), strict=True):
        assert len(out.logprobs) == len(out.token_ids) == N
        ref = hf_logits(model, prompt + list(out.token_ids)).log_softmax(-1)[len(prompt) - 1 : -1]  # [N, V]
        for i, (token, lp) in enumerate(zip(out.token_ids, out.logprobs, strict=True)):
            assert lp.token_id == token
            assert math.isclose(lp.logprob, ref[i, token].item(), abs_tol=1e-4)
            top_vals, top_ids = ref[i].topk(5)
            assert [t for t, _, _ in lp.top] == top_ids.tolist()
            assert all(math.isclose(v, r, abs_tol=1e-4) for (_, _, v), r in zip(lp.top, top_vals.tolist(), strict=True))
            assert lp.token == llm.tokenizer.decode([token]) and lp.top[0][1] == llm.tokenizer.decode([top_ids[0].item()])
            if temperature == 0.0:
                assert lp.top[0][0] == token  # greedy picks the most likely token


def test_no_logprobs_unless_asked(tiny):
    _, llm = tiny
    (out,) = llm.generate([PROMPTS[0]], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
    assert out.logprobs is None
    (zero,) = llm.generate([PROMPTS[0]], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, logprobs=0))
    assert len(zero.logprobs) == 4 and all(lp.top == () for lp in zero.logprobs)


# ---- penalties -----------------------------------------------------------------------------------


def test_repetition_penalty_is_hfs():
    from transformers import RepetitionPenaltyLogitsProcessor

    torch.manual_seed(0)
    logits = torch.randn(1, 300) * 3
    prompt, output = [5, 6, 7, 7], [7, 100, 299]
    ours = apply_penalties(logits[0], SamplingParams(repetition_penalty=1.7), prompt, output)
    ref = RepetitionPenaltyLogitsProcessor(1.7)(torch.tensor([prompt + output]), logits.clone())[0]
    torch.testing.assert_close(ours, ref)


def test_presence_and_frequency_penalties_follow_openais_formula():
    torch.manual_seed(1)
    logits = torch.randn(200)
    output = [3, 3, 3, 9, 150]
    ours = apply_penalties(logits, SamplingParams(presence_penalty=0.5, frequency_penalty=-0.25), [3, 4], output)
    ref = logits.clone()
    for token in set(output):  # mu[j] - c[j] * alpha_frequency - float(c[j] > 0) * alpha_presence
        ref[token] -= output.count(token) * -0.25 + 0.5
    torch.testing.assert_close(ours, ref)
    untouched = process_logits(logits.unsqueeze(0), [SamplingParams()], [[3]], [[3]], [()])
    assert untouched.data_ptr() == logits.data_ptr()  # no copy when nothing applies


def test_repetition_penalty_greedy_matches_hf_generate(tiny):
    model, llm = tiny
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=N, ignore_eos=True, repetition_penalty=1.5))
    plain = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=N, ignore_eos=True))
    for prompt, out in zip(PROMPTS, outs, strict=True):
        assert list(out.token_ids) == hf_generate(model, prompt, N, min_new_tokens=N, repetition_penalty=1.5)
    assert [o.token_ids for o in outs] != [o.token_ids for o in plain]  # the penalty changed something


def test_presence_frequency_greedy_matches_a_reference_loop(tiny):
    model, llm = tiny
    params = SamplingParams(temperature=0.0, max_tokens=N, ignore_eos=True, presence_penalty=1.0, frequency_penalty=0.7)
    for prompt, out in zip(PROMPTS, llm.generate(PROMPTS, params), strict=True):
        generated: list[int] = []
        for _ in range(N):
            logits = hf_logits(model, prompt + generated)[-1]
            for token in set(generated):
                logits[token] -= 0.7 * generated.count(token) + 1.0
            generated.append(int(logits.argmax()))
        assert list(out.token_ids) == generated


# ---- min_tokens and stop_token_ids ---------------------------------------------------------------


def test_min_tokens_matches_hf_min_new_tokens(tiny):
    model, llm = tiny
    free = hf_generate(model, PROMPTS[0], N, min_new_tokens=N)
    stop_id = free[2]  # an id generated early: as a stop token it would end the output at once
    first = free.index(stop_id)
    (early,) = llm.generate([PROMPTS[0]], SamplingParams(temperature=0.0, max_tokens=N, stop_token_ids=(stop_id,)))
    assert list(early.token_ids) == free[: first + 1] and early.finish_reason == "stop"
    (held,) = llm.generate([PROMPTS[0]], SamplingParams(temperature=0.0, max_tokens=N, stop_token_ids=(stop_id,), min_tokens=8))
    ref = hf_generate(model, PROMPTS[0], N, min_new_tokens=8, eos_token_id=[stop_id, tc.END_OF_TEXT, tc.EOT])
    assert list(held.token_ids) == ref and len(held.token_ids) >= 8
    assert stop_id not in held.token_ids[:8]


# ---- context length --------------------------------------------------------------------------------


def test_prompt_plus_max_tokens_beyond_the_context_is_rejected_naming_both(tiny):
    _, llm = tiny
    assert llm.engine.max_model_len == 256  # the config's max_position_embeddings
    prompt = PROMPTS[0]  # 5 tokens: room for 251
    with pytest.raises(ValueError, match=r"^max_tokens: the prompt's 5 tokens plus max_tokens=252 exceed the context length "
                                         r"of 256 tokens \(at most 251 tokens can be generated\)"):
        llm.generate([prompt], SamplingParams(max_tokens=252))
    assert not llm.engine.has_unfinished_requests()
    (out,) = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=None, ignore_eos=True))
    assert len(out.token_ids) == 251 and out.finish_reason == "length"  # the room left, and says so
    assert out.metrics.num_generation_tokens == 251
