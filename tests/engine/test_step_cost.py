"""The online step-cost fit recovers known coefficients and degrades sensibly on thin data."""

from __future__ import annotations

import random
import threading

import pytest

from serve_app.engine.step_cost import StepCostFit, fit_step_cost


def test_fit_recovers_known_costs_with_noise():
    rng = random.Random(0)
    fit = StepCostFit(window=200)
    for _ in range(300):
        p, d = rng.choice([0, 0, 64, 256, 512]), rng.randint(1, 32)
        fit.observe(p, d, 0.010 + 0.0004 * p + 0.002 * d + rng.gauss(0, 0.0005))
    cost = fit.cost()
    assert cost is not None and cost.num_steps == 200  # the window keeps only the newest steps
    assert cost.fixed_s == pytest.approx(0.010, abs=0.001)
    assert cost.per_prefill_token_s == pytest.approx(0.0004, rel=0.05)
    assert cost.per_decode_token_s == pytest.approx(0.002, rel=0.05)
    assert cost.predict(100, 10) == pytest.approx(0.010 + 0.04 + 0.02, rel=0.05)


def test_window_follows_a_change_of_speed():
    fit = StepCostFit(window=20, min_steps=3)
    for i in range(40):
        fit.observe(10 * (i % 5), 1 + i % 3, 0.001 * 10 * (i % 5) + 0.001 * (1 + i % 3))
    for i in range(20):  # the machine got twice as slow
        fit.observe(10 * (i % 5), 1 + i % 3, 0.002 * 10 * (i % 5) + 0.002 * (1 + i % 3))
    assert fit.cost().per_prefill_token_s == pytest.approx(0.002, rel=1e-6)


def test_undetermined_coefficients_fall_back():
    assert StepCostFit(min_steps=8).cost() is None  # too few steps
    decode_only = fit_step_cost([(0, d, 0.005 + 0.001 * d) for d in (1, 2, 4, 8)])
    assert decode_only.per_decode_token_s == pytest.approx(0.001)
    assert decode_only.per_prefill_token_s == decode_only.per_decode_token_s  # no prompt seen: same as decode
    assert decode_only.determined is False  # 4 steps: too few to trust the split
    same_shape = fit_step_cost([(0, 4, 0.02), (0, 4, 0.04)])
    assert same_shape.fixed_s == 0 and same_shape.per_decode_token_s == pytest.approx(0.03 / 4) and not same_shape.determined
    assert fit_step_cost([]) is None
    # noise (a shared machine) can make tokens look free or cheaper than nothing: the step time is then
    # taken as proportional to its tokens, so a token always costs something
    noisy = fit_step_cost([(0, 1, 1.9), (0, 2, 1.7), (0, 3, 1.8), (10, 1, 1.75), (64, 2, 1.8)])
    assert noisy.fixed_s == 0 and noisy.per_prefill_token_s > 0 and noisy.per_decode_token_s == noisy.per_prefill_token_s
    assert not noisy.determined


def test_observe_and_cost_from_two_threads():
    fit = StepCostFit(window=64, min_steps=3)
    stop = threading.Event()

    def writer():
        i = 0
        while not stop.is_set():
            fit.observe(i % 7 * 16, 1 + i % 5, 0.001 + 0.0001 * (i % 7 * 16) + 0.0005 * (1 + i % 5))
            i += 1

    thread = threading.Thread(target=writer)
    thread.start()
    try:
        costs = [fit.cost() for _ in range(200)]
    finally:
        stop.set()
        thread.join()
    assert any(c is not None for c in costs)
    assert fit.cost().per_prefill_token_s == pytest.approx(0.0001, rel=1e-3)
