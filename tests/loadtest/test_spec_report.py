"""The W5 report's target checks on synthetic rows (no model, no engine)."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "loadtest"))

from spec_report import targets  # noqa: E402


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
