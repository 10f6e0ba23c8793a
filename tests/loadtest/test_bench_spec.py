"""W5's closed loop, summary and target checks on synthetic runs (no model, no engine)."""

from __future__ import annotations

import pytest

from loadtest.bench_spec import closed_loop, summarize, targets


def row(workload: str, c: int, setting: str, tok_s: float, speedup: float | None) -> dict:
    return {"workload": workload, "concurrency": c, "setting": setting, "tok_s": tok_s, "tok_s_min": tok_s, "tok_s_max": tok_s,
            "speedup": speedup}


def test_targets_compare_adaptive_with_vllm_off_and_the_best_fixed_k():
    rows = [
        row("grounded", 1, "native adaptive", 30.0, 1.5), row("grounded", 1, "vLLM ngram k=4", 40.0, 1.4),
        row("grounded", 1, "native k=2", 25.0, 1.25), row("grounded", 1, "native k=4", 31.0, 1.55),
        row("grounded", 64, "native adaptive", 150.0, 0.96), row("grounded", 64, "native k=2", 140.0, 0.9),
        row("grounded", 64, "native k=4", 130.0, 0.84),
    ]
    found = {t: (m, met) for t, m, met in targets(rows)}
    assert found["grounded, concurrency 1: adaptive's speedup over off >= vLLM n-gram's over its off"] == ("1.50x vs 1.40x", True)
    assert found["grounded, concurrency 64: adaptive >= 0.97x off"] == ("0.96x", False)
    within = {t: met for t, (_, met) in found.items() if "within 5%" in t}
    assert within == {"grounded, concurrency 1: adaptive within 5% of the best fixed k (native k=4)": True,  # 30 / 31
                      "grounded, concurrency 64: adaptive within 5% of the best fixed k (native k=2)": True}
    rows[0]["tok_s"] = 29.0  # 29 / 31 = 0.935
    assert not next(met for t, _, met in targets(rows) if t.startswith("grounded, concurrency 1: adaptive within"))


def test_no_rows_no_targets():
    assert targets([]) == []


def test_summary_speedup_over_the_same_engines_baseline_and_identity():
    def run(setting, tok_s, ids, proposed=0, accepted=0):
        return {"workload": "grounded", "concurrency": 4, "setting": setting, "num_tokens": 100, "elapsed_s": 100 / tok_s, "tpot_s": [0.01, 0.03],
                "proposed": proposed, "accepted": accepted, "candidates": 10 if setting.startswith("native") else None, "token_ids": ids}

    rows = summarize([run("native off", 10.0, [[1, 2]]), run("native k=4", 15.0, [[1, 2]], 40, 30), run("native k=4", 25.0, [[1, 2]], 40, 30),
                      run("vLLM ngram k=4", 30.0, [[1, 3]], 8, 4), run("vLLM off", 20.0, [[1, 2]])])
    by = {r["setting"]: r for r in rows}
    assert [r["setting"] for r in rows] == ["native off", "native k=4", "vLLM off", "vLLM ngram k=4"]
    assert by["native k=4"]["speedup"] == pytest.approx(2.0) and by["native k=4"]["speedup_min"] == pytest.approx(1.5)
    assert by["native k=4"]["acceptance"] == pytest.approx(0.75) and by["native k=4"]["mean_k"] == pytest.approx(4.0)
    assert by["native k=4"]["identical"] and by["vLLM ngram k=4"]["identical"] is False  # against vLLM's own baseline
    assert by["vLLM ngram k=4"]["speedup"] == pytest.approx(1.5) and by["vLLM ngram k=4"]["mean_k"] is None
    assert by["native off"]["tpot_p50_ms"] == pytest.approx(20.0)


def test_closed_loop_keeps_the_concurrency_and_times_at_step_boundaries():
    in_flight, peak, steps = {}, [0], []

    def add(rid, prompt):
        in_flight[rid] = 0
        peak[0] = max(peak[0], len(in_flight))

    def step():  # every request in flight gains a token; one finishes at 3 tokens
        steps.append(len(in_flight))
        out = []
        for rid in list(in_flight):
            in_flight[rid] += 1
            out.append((rid, in_flight[rid], in_flight[rid] == 3))
            if in_flight[rid] == 3:
                del in_flight[rid]
        return out

    result = closed_loop([[1]] * 5, 2, add, step)
    assert peak[0] == 2 and result["num_tokens"] == 15 and len(result["tpot_s"]) == 5 and all(t >= 0 for t in result["tpot_s"])
