"""Speculative decoding on the real model: outputs are token-for-token those without speculation
(greedy: those of HF transformers), for every k, batch composition and scheduling condition."""

from __future__ import annotations

import pytest

from serve_app.engine import LLM, SamplingParams
from tests.engine.conftest import MAX_TOKENS
from tests.recording_logger import RecordingLogger

pytestmark = pytest.mark.heavy  # the real model with and without speculation, against HF: make test, not make test-fast

GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
PARAGRAPH = ("The old lighthouse keeper climbed the spiral stairs every evening at dusk, lit the great lamp, "
             "and wrote the names of passing ships in a leather notebook that his grandfather had given him.")
SPECS = [{"method": "ngram", "k": 1}, {"method": "ngram", "k": 2}, {"method": "ngram", "k": 4}, {"method": "ngram"}]
SPEC_IDS = ["k1", "k2", "k4", "adaptive"]


@pytest.fixture(scope="module")
def copy_prompts(tokenizer) -> list[list[int]]:
    """Chats whose replies copy text from the prompt: prompt lookup gets proposals accepted."""
    asks = [f"Copy this paragraph word for word:\n\n{PARAGRAPH}",
            f"Repeat the following text exactly, then stop:\n\n{PARAGRAPH}",
            "Write the numbers from one to twenty as words, separated by commas: one, two, three, four, five,"]
    return [list(tokenizer.apply_chat_template([{"role": "user", "content": a}], add_generation_prompt=True,
                                              return_dict=True)["input_ids"]) for a in asks]


def run(model_dir, prompts, params, spec=None, **kwargs):
    stats = RecordingLogger()
    llm = LLM(model_dir, dtype="float32", stat_loggers=[stats], speculative=spec, **kwargs)
    deltas = []
    outs = llm.generate(prompts, params, on_step=lambda step: deltas.extend(len(o.token_ids) for o in step))
    bm = llm.engine.core.block_manager
    bm.check_integrity()
    assert bm.num_used_blocks == 0
    return [list(o.token_ids) for o in outs], [o.text for o in outs], stats, deltas


@pytest.fixture(scope="module")
def copy_reference(model_dir, copy_prompts):
    params = SamplingParams(temperature=0.0, max_tokens=64)
    return run(model_dir, copy_prompts, params)[0]


@pytest.mark.parametrize("spec", SPECS, ids=SPEC_IDS)
def test_greedy_equals_hf_and_no_speculation(model_dir, prompt_ids, hf_reference, copy_prompts, copy_reference, spec):
    prompts = prompt_ids + copy_prompts
    params = [GREEDY] * len(prompt_ids) + [SamplingParams(temperature=0.0, max_tokens=64)] * len(copy_prompts)
    tokens, _, stats, deltas = run(model_dir, prompts, params, spec)
    assert tokens == hf_reference + copy_reference
    proposed = sum(s.spec_num_proposed for s in stats.steps)
    accepted = sum(s.spec_num_accepted for s in stats.steps)
    assert accepted > 0 and proposed > accepted  # both acceptances and rejections (rolled back) happened
    assert max(deltas) > 1  # a step's accepted tokens came out as one delta
    if spec.get("k"):
        assert max(s.spec_num_proposed / s.spec_num_seqs for s in stats.steps if s.spec_num_seqs) == spec["k"]


@pytest.mark.parametrize("condition", [
    {"num_blocks": 14, "block_size": 16},  # preemption by recompute
    {"max_num_batched_tokens": 24, "enable_prefix_caching": False},  # chunked prefill next to verifications
    {"max_num_seqs": 1},  # one at a time: later prompts hit the prefix cache
    {"batching": "static", "batch_size": 3, "max_num_seqs": 3, "batch_timeout_s": 0.0},
])
def test_greedy_under_scheduling_conditions(model_dir, prompt_ids, hf_reference, copy_prompts, copy_reference, condition):
    prompts = prompt_ids + copy_prompts
    params = [GREEDY] * len(prompt_ids) + [SamplingParams(temperature=0.0, max_tokens=64)] * len(copy_prompts)
    tokens, _, stats, _ = run(model_dir, prompts, params, {"method": "ngram", "k": 3}, **condition)
    assert tokens == hf_reference + copy_reference
    assert sum(s.spec_num_accepted for s in stats.steps) > 0
    if "num_blocks" in condition:
        assert sum(s.num_preempted for s in stats.steps) > 0
    if condition.get("max_num_seqs") == 1:
        assert sum(s.prefix_cache_hits for s in stats.steps) > 0


def test_seeded_sampling_is_identical_in_any_batch(model_dir, prompt_ids, copy_prompts):
    """Seeded samples keep their per-position draws: same output with speculation on or off, whatever
    k and whatever shares the batch (greedy rows, an opted-out request, other seeds)."""
    prompts = copy_prompts + prompt_ids[:4]
    params = [SamplingParams(temperature=0.7, top_p=0.9, seed=11 + i, max_tokens=48) for i in range(len(prompts))]
    params[3] = SamplingParams(temperature=0.0, max_tokens=48)
    params[4] = SamplingParams(temperature=1.0, top_k=20, seed=5, max_tokens=48, speculative=False)
    reference, *_ = run(model_dir, prompts, params)
    for spec in SPECS:
        tokens, _, stats, _ = run(model_dir, prompts, params, spec)
        assert tokens == reference, spec
        assert sum(s.spec_num_accepted for s in stats.steps) > 0
    # alone in its batch, a seeded request produces the same tokens too
    alone, *_ = run(model_dir, prompts[:1], params[:1], {"method": "ngram", "k": 4})
    assert alone[0] == reference[0]


def test_stop_conditions_across_accepted_tokens(model_dir, copy_prompts):
    """A stop string, max_tokens, EOS and ignore_eos cut a multi-token step exactly where decoding
    one token per step would have stopped."""
    params = [
        SamplingParams(temperature=0.0, max_tokens=64, stop=("spiral stairs",)),
        SamplingParams(temperature=0.0, max_tokens=13),
        SamplingParams(temperature=0.0, max_tokens=80, ignore_eos=True),
    ]
    prompts = copy_prompts[:2] + copy_prompts[:1]
    ref_tokens, ref_text, *_ = run(model_dir, prompts, params)
    assert "spiral" not in ref_text[0] and ref_text[0]
    assert len(ref_tokens[1]) == 13 and len(ref_tokens[2]) == 80
    for spec in ({"method": "ngram", "k": 4}, {"method": "ngram"}):
        tokens, text, stats, _ = run(model_dir, prompts, params, spec)
        assert (tokens, text) == (ref_tokens, ref_text)
        assert sum(s.spec_num_accepted for s in stats.steps) > 0


def test_opted_out_requests_are_never_verified(model_dir, copy_prompts):
    params = SamplingParams(temperature=0.0, max_tokens=32, speculative=False)
    _, _, stats, _ = run(model_dir, copy_prompts, params, {"method": "ngram", "k": 4})
    assert sum(s.spec_num_proposed for s in stats.steps) == 0


def test_speculation_counters_after_known_traffic(model_dir, copy_prompts):
    """The exported counters equal the engine's own per-step numbers."""
    from serve_app.metrics.loggers import PrometheusStatLogger

    metrics, stats = PrometheusStatLogger("m"), RecordingLogger()
    llm = LLM(model_dir, dtype="float32", stat_loggers=[metrics, stats], speculative={"method": "ngram", "k": 3})
    llm.generate(copy_prompts[:2], SamplingParams(temperature=0.0, max_tokens=40))
    value = {name: metrics.registry.get_sample_value(name, {"model": "m"}) for name in (
        "llm_spec_proposed_tokens_total", "llm_spec_accepted_tokens_total", "llm_spec_verified_requests_total",
        "llm_spec_decode_requests_total")}
    assert value["llm_spec_proposed_tokens_total"] == sum(s.spec_num_proposed for s in stats.steps) > 0
    assert value["llm_spec_accepted_tokens_total"] == sum(s.spec_num_accepted for s in stats.steps) > 0
    assert value["llm_spec_verified_requests_total"] == sum(s.spec_num_seqs for s in stats.steps)
    assert value["llm_spec_decode_requests_total"] == sum(s.spec_num_candidates for s in stats.steps)
    # each verified request-step proposed exactly k=3 tokens, or fewer near max_tokens / without a longer match
    assert value["llm_spec_proposed_tokens_total"] <= 3 * value["llm_spec_verified_requests_total"]
