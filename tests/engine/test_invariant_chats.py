"""The committed chats (data/invariance_chats.json) answer the same whatever the prefix cache holds and
whatever else runs: in the default configuration (bf16, prefix caching on, the paths this CPU picks),
30 greedy chats (10 short factual questions asked alone after a warm-up chat, as second turns of a
conversation, and all at once beside unrelated prompts) are token-identical to the same conversations
answered one at a time by an engine without a prefix cache, and so is every sampled position's fp32
logits row."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from serve_app.engine import LLM
from serve_app.types import SamplingParams
from tests.engine.logits_recorder import LogitsRecorder

pytestmark = pytest.mark.heavy  # thirty chats, alone and together: make test, not make test-fast

CHATS = json.loads((Path(__file__).parent / "data" / "invariance_chats.json").read_text())


def user(text: str) -> dict:
    return {"role": "user", "content": text}


def test_thirty_chats_answer_as_they_do_alone_without_a_prefix_cache(model_dir):
    params = SamplingParams(temperature=0.0, max_tokens=CHATS["max_tokens"])
    questions = CHATS["questions"]
    served = LLM(model_dir, dtype="bfloat16")
    assert served.engine.core.model_runner.batch_invariant
    served_rows = LogitsRecorder(served)
    served.chat([[user(CHATS["warm_up"])]], SamplingParams(temperature=0.0, max_tokens=4))
    alone = [served.chat([[user(q)]], params)[0].text for q in questions]
    first = [user(CHATS["first_turn"]), {"role": "assistant", "content": served.chat([[user(CHATS["first_turn"])]], params)[0].text}]
    second_outs = [served.chat([[*first, user(q)]], params)[0] for q in questions]
    second = [o.text for o in second_outs]
    assert all(o.metrics.num_cached_tokens >= 32 for o in second_outs)  # they read the first turn from the cache
    mixed = served.chat([[user(q)] for q in questions] + [[user(u)] for u in CHATS["unrelated"]], params)
    mixed = [o.text for o in mixed[: len(questions)]]

    reference = LLM(model_dir, dtype="bfloat16", enable_prefix_caching=False)
    reference_rows = LogitsRecorder(reference)
    expected = [reference.chat([[user(q)]], params)[0].text for q in questions]
    assert reference.chat([[user(CHATS["first_turn"])]], params)[0].text == first[1]["content"]
    expected_second = [reference.chat([[*first, user(q)]], params)[0].text for q in questions]

    assert alone == expected
    assert mixed == expected
    assert second == expected_second
    assert "Paris" in expected[0]
    common, same, worst = served_rows.compare(reference_rows)
    assert common > 30 * 10 and same == common, f"{common - same} of {common} positions differ (by up to {worst})"
