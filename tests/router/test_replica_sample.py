"""A replica's published routing stats as the routers read them (replica_sample)."""

from __future__ import annotations

from serve_app.serving.replica_sample import ReplicaSample


def test_published_stats_parse_and_missing_fields_take_their_defaults():
    full = ReplicaSample.parse({"kv_cache_usage": 0.25, "num_free_blocks": 70, "num_total_blocks": 100, "num_waiting": 3,
                                "num_running": 5, "sampled_at": 12.5, "num_pending_prompt_tokens": 640, "step_fixed_s": 0.02,
                                "prefill_s_per_token": 0.001, "decode_s_per_token": 0.003, "kv_pending": [1, 2]})
    assert full == ReplicaSample(0.25, 70, 100, 3, 5, 12.5, 640, 0.02, 0.001, 0.003)
    assert full.num_used_blocks == 30
    minimal = ReplicaSample.parse({"kv_cache_usage": 0.25, "num_total_blocks": 100})
    assert minimal == ReplicaSample(0.25, 75, 100, 0, 0, None)  # free blocks from the usage; no timestamp


def test_no_sample_or_a_malformed_one_is_none():
    assert ReplicaSample.parse(None) is None and ReplicaSample.parse({}) is None
    assert ReplicaSample.parse({"kv_cache_usage": 0.5}) is None  # no total
    assert ReplicaSample.parse({"kv_cache_usage": "half", "num_total_blocks": 100}) is None


def test_queued_prompt_tokens_of_an_old_sample_drain_at_the_replicas_fitted_rate():
    sample = ReplicaSample(0.1, 90, 100, 0, 2, 1000.0, 400, step_fixed_s=0.01, prefill_s_per_token=0.001,
                           decode_s_per_token=0.002)
    per_token = 0.001 + (0.01 + 2 * 0.002) / 512
    assert sample.unread_prompt_tokens(0.0, 512) == 400
    assert sample.unread_prompt_tokens(0.2, 512) == 400 - int(0.2 / per_token)
    assert sample.unread_prompt_tokens(5.0, 512) == 0
    no_fit = ReplicaSample(0.1, 90, 100, 0, 2, 1000.0, 400)
    assert no_fit.unread_prompt_tokens(5.0, 512) == 400  # nothing measured: nothing assumed read
