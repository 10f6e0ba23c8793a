"""Unit-level benchmark: the prefix-aware router's per-decision expiry of outstanding predictions.

Every routing decision first forgets predictions whose report never came (`_expire_predictions`).
It used to scan every outstanding prediction (and every pending choice) per decision; it now pops
only what is due from a time-ordered queue (`serving.expiring_map.ExpiringMap`). This measures one
decision's expiry call with n outstanding predictions and n pending choices, nothing due (the
steady state of a flood: many outstanding, few expiring per decision), for the router as it is and
for the previous full scan (reproduced here as `scan_expiry`, on the same sizes), then the cost of
expiring everything once due (amortized per entry).

    python loadtest/bench_router_expiry.py                  # writes reports/router_expiry.{json,md}
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from serve_app.serving.prefix_router import PrefixAwareRouter  # noqa: E402
from tests.router.fakes import Clock, FakeReplica, make_router  # noqa: E402

SIZES = (1_000, 10_000, 66_000, 200_000)
TTL_S = 660.0


def scan_expiry(predictions: dict, choices: dict, ledger_entries: dict, now: float, ttl: float) -> None:
    """The previous per-decision expiry: a scan of every outstanding prediction and choice."""
    if len(predictions) > 64:
        for request_id in [r for r, (_, _, at) in predictions.items() if now - at > ttl]:
            del predictions[request_id]
    for internal_id in [i for i in choices if i not in ledger_entries]:
        del choices[internal_id]


def per_call_us(fn, repeats: int) -> float:
    best = float("inf")
    for _ in range(3):
        started = time.perf_counter()
        for _ in range(repeats):
            fn()
        best = min(best, (time.perf_counter() - started) / repeats)
    return best * 1e6


async def measure(n: int) -> dict:
    clock = Clock(1_000.0)
    router = make_router(PrefixAwareRouter, clock, [FakeReplica("r0")], confirmed_ttl_s=TTL_S)
    for i in range(n):
        router.predictions.set(f"req-{i}", (64, "exact", clock.now), clock.now)
        router._choices.set(f"int-{i}", (None, "r0", {}), clock.now)
    clock.now += 1.0
    repeats = max(20, 200_000 // n)
    new_us = per_call_us(lambda: router._expire_predictions(clock.now), repeats * 10)

    predictions = {f"req-{i}": (64, "exact", 1_000.0) for i in range(n)}
    choices = {f"int-{i}": None for i in range(n)}
    ledger = dict.fromkeys(choices)  # every choice still reserved: nothing to drop, the scan still runs
    old_us = per_call_us(lambda: scan_expiry(predictions, choices, ledger, 1_001.0, TTL_S), repeats)

    clock.now += TTL_S + 61.0  # everything due at once: later decisions drop it, a bounded share each
    worst_s, total_s, calls = 0.0, 0.0, 0
    while len(router.predictions) or len(router._choices):
        started = time.perf_counter()
        router._expire_predictions(clock.now)
        elapsed = time.perf_counter() - started
        worst_s, total_s, calls = max(worst_s, elapsed), total_s + elapsed, calls + 1
    return {"outstanding": n, "expiry_per_decision_us": round(new_us, 3), "previous_scan_per_decision_us": round(old_us, 1),
            "speedup": round(old_us / new_us, 1), "all_due_decisions_to_clear": calls,
            "all_due_worst_decision_us": round(worst_s * 1e6, 1), "all_due_per_entry_us": round(total_s / (2 * n) * 1e6, 3)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(REPO / "reports" / "router_expiry"))
    args = parser.parse_args()
    rows = [asyncio.run(measure(n)) for n in SIZES]
    load = os.getloadavg()
    result = {"command": "python loadtest/bench_router_expiry.py", "machine": platform.processor() or platform.machine(),
              "load_avg_at_end": [round(x, 2) for x in load], "ttl_s": TTL_S, "rows": rows}
    Path(args.out + ".json").write_text(json.dumps(result, indent=2) + "\n")
    lines = ["# Router prediction expiry per routing decision", "",
             f"Command: `{result['command']}` (load average at the end: {result['load_avg_at_end'][0]}).", "",
             "Outstanding predictions and pending choices: n each, none due. `previous scan` reproduces the",
             "per-decision scan the router used before `ExpiringMap`. Single process, wall clock (best of 3).", "",
             "| outstanding n | expiry per decision (µs) | previous scan (µs) | speed-up | all due at once: decisions to clear | worst decision (µs) | per entry (µs) |",
             "|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['outstanding']:,} | {r['expiry_per_decision_us']} | {r['previous_scan_per_decision_us']} | "
                     f"{r['speedup']}× | {r['all_due_decisions_to_clear']:,} | {r['all_due_worst_decision_us']} | {r['all_due_per_entry_us']} |")
    Path(args.out + ".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
