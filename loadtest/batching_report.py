"""W2 batching study reports: batching.json (summaries, per-request timings, per-step batch sizes),
batching.md (headline table, targets, explanation) and the PNGs (timelines, batch size over time).

`results` is what loadtest/bench_batching.py builds: {"workload", "settings", "machine", "command",
"date", "duration_s", "comparison", "policies": {name: {"summary", "requests", "steps"}}}; each step
dict has start_s, duration_s, num_seqs, num_prefill_tokens, num_decode_tokens, num_waiting and
batch ((request_id, num_tokens, reads_prompt), ...).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from batching_trace import StepRecord, quantile, timeline_segments

TARGET_THROUGHPUT_RATIO = 2.5  # target: continuous >= 2.5x static output tok/s
TARGET_TTFT_RATIO = 0.5  # and TTFT p50 <= 0.5x static
COLORS = {"queue": "#cfcfcf", "prefill": "tab:orange", "decode": "tab:blue"}


def _steps(policy: dict) -> list[StepRecord]:
    return [StepRecord(**{**s, "batch": tuple(tuple(b) for b in s["batch"])}) for s in policy["steps"]]


def compact(results: dict[str, Any]) -> dict[str, Any]:
    """The committed JSON: summaries, the pure-decode step cost table and per-request timings; the
    per-step data (batch sizes, who was in each step: what the PNGs show) goes to the raw JSON in build/."""
    out = {k: v for k, v in results.items() if k != "policies"}
    out["decode_step_cost"] = decode_step_cost(results)
    out["step_cost_model"] = step_cost_model(results)
    out["policies"] = {name: {"summary": p["summary"], "requests": p["requests"]} for name, p in results["policies"].items()}
    return out


# ---- Markdown ----------------------------------------------------------------------------------------
def _f(value: float | None, fmt: str = ".2f") -> str:
    return "–" if value is None else format(value, fmt)


def headline_table(results: dict[str, Any]) -> list[str]:
    cmp_ = results.get("comparison", {})
    lines = ["| policy | output tok/s | req/s | TTFT p50 (s) | TTFT p99 (s) | e2e p50 (s) | e2e p99 (s) | mean batch size | "
             "tok/s vs static | TTFT p50 vs static |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for name, p in results["policies"].items():
        s = p["summary"]
        c = cmp_.get(name, {})
        ratio = "–" if c.get("output_tok_s_ratio") is None else f"{c['output_tok_s_ratio']:.2f}x"
        ttft = "–" if c.get("ttft_p50_ratio") is None else f"{c['ttft_p50_ratio']:.2f}x"
        flag = "" if s.get("complete", True) else " (incomplete)"
        lines.append(f"| {name}{flag} | {s['output_tok_s']:.1f} | {s['request_throughput']:.2f} | {_f(s['ttft_p50_s'])} | "
                     f"{_f(s['ttft_p99_s'])} | {_f(s['e2e_p50_s'])} | {_f(s['e2e_p99_s'])} | {s['mean_batch_size']:.1f} | {ratio} | {ttft} |")
    return lines


def targets(results: dict[str, Any]) -> list[str]:
    c = results.get("comparison", {}).get("continuous")
    if not c or "static" not in results["policies"]:
        return ["- targets: need both static and continuous in one run"]
    tput, ttft = c["output_tok_s_ratio"], c["ttft_p50_ratio"]
    lines = [f"- throughput: continuous / static = **{tput:.2f}x** (target ≥ {TARGET_THROUGHPUT_RATIO}x): "
             + ("met" if tput >= TARGET_THROUGHPUT_RATIO else "**not met**")]
    if ttft is not None:
        lines.append(f"- TTFT p50: continuous / static = **{ttft:.2f}x** (target ≤ {TARGET_TTFT_RATIO}x): "
                     + ("met" if ttft <= TARGET_TTFT_RATIO else "**not met**"))
    return lines


DECODE_BUCKETS = ((1, 4), (5, 8), (9, 16), (17, 32), (33, 64), (65, 512))


def decode_step_cost(results: dict[str, Any]) -> list[dict]:
    """Median wall time of pure-decode steps (no prompt tokens) by batch size, over every policy's steps:
    how much a step's cost grows with the number of sequences in it."""
    steps = [st for p in results["policies"].values() for st in p["steps"] if st["num_prefill_tokens"] == 0 and st["num_seqs"]]
    rows = []
    for lo, hi in DECODE_BUCKETS:
        durations = [st["duration_s"] for st in steps if lo <= st["num_seqs"] <= hi]
        if durations:
            med = quantile(durations, 0.5)
            rows.append({"batch": f"{lo}-{hi}", "num_steps": len(durations), "median_ms": med * 1000,
                         "median_ms_per_token": med * 1000 / quantile([st["num_seqs"] for st in steps if lo <= st["num_seqs"] <= hi], 0.5)})
    return rows


def fit_step_cost(steps: list[dict]) -> tuple[float, float, float, float] | None:
    """Least-squares fit of step seconds = fixed + per_decode x decode tokens + per_prompt x prompt
    tokens over `steps`; (fixed, per_decode, per_prompt, R²), or None with fewer than 3 distinct steps."""
    import numpy as np

    x = np.array([[1.0, st["num_decode_tokens"], st["num_prefill_tokens"]] for st in steps]).reshape(-1, 3)
    if len(steps) < 3 or np.linalg.matrix_rank(x) < 3:
        return None
    y = np.array([st["duration_s"] for st in steps])
    coef = np.linalg.lstsq(x, y, rcond=None)[0]
    r2 = float(1 - ((y - x @ coef) ** 2).sum() / max(((y - y.mean()) ** 2).sum(), 1e-12))
    return float(coef[0]), float(coef[1]), float(coef[2]), r2


def makespan_lower_bound(requests: list[tuple[float, int, int]], fixed: float, per_decode: float, per_prompt: float,
                         cap: int, budget: int) -> dict[str, Any]:
    """The shortest makespan (first arrival → last finish) any admission policy could reach on this
    trace if every step cost what the model says; `requests`: (arrival_s, prompt tokens, output tokens).

    Two facts bound it, and the larger answer holds:
    - work: nothing that arrives at t can run before t, and that work takes at least its decode tokens
      in full steps of `cap` sequences (their fixed cost) plus its per-token costs: for every arrival
      t, t + that engine time of the requests arriving from t on (at the first arrival: the whole
      trace in full steps);
    - chains: a request of P prompt and L output tokens needs ceil(P / budget) + L - 1 steps one after
      the other from its arrival, each paying the fixed cost, and all the per-token work of the trace
      must run too, except what fits before that arrival (no more than the time there is, nor the
      work that has arrived by then)."""
    reqs = sorted(requests)
    t0 = reqs[0][0]
    tok = [per_decode * (out - 1) + per_prompt * prompt for _, prompt, out in reqs]
    total_tok = sum(tok)
    work_s = chain_s = 0.0
    suffix_decodes, suffix_tok = 0, 0.0
    for i in range(len(reqs) - 1, -1, -1):  # every arrival, with the work arriving from it on
        arrival, prompt, out = reqs[i]
        suffix_decodes += out - 1
        suffix_tok += tok[i]
        work_s = max(work_s, arrival - t0 + math.ceil(suffix_decodes / cap) * fixed + suffix_tok)
    before_tok = 0.0
    for i, (arrival, prompt, out) in enumerate(reqs):
        a = arrival - t0
        steps = math.ceil(prompt / budget) + out - 1
        chain_s = max(chain_s, a + steps * fixed + total_tok - min(a, before_tok))
        before_tok += tok[i]
    return {"bound_s": max(work_s, chain_s), "work_bound_s": work_s, "chain_bound_s": chain_s,
            "binding": "work" if work_s >= chain_s else "chain"}


def step_cost_model(results: dict[str, Any]) -> dict[str, Any] | None:
    """The step-cost fit over every policy's steps and what it implies: each policy's engine time as
    predicted (how well three numbers explain the run), the engine time of an ideal continuous
    batcher that runs every decode step full (`max_num_seqs` sequences) on the same tokens, and the
    shortest makespan any admission policy could reach on this trace (`makespan_lower_bound`, when
    the workload lists its requests). Static's makespan over that bounds the throughput ratio any
    policy can reach on this machine and trace; with the fixed cost alone (a step costing the same at
    1 and at `max_num_seqs` sequences, a memory-bound GPU's regime) the bound is static's step count
    over the ideal's. None with fewer than 3 distinct steps."""
    import numpy as np

    steps = [st for p in results["policies"].values() for st in p["steps"]]
    fit = fit_step_cost(steps)
    if fit is None:
        return None
    fixed, per_decode, per_prefill, r2 = fit
    coef = np.array([fixed, per_decode, per_prefill])
    predicted = {}
    for name, p in results["policies"].items():
        px = np.array([[1.0, st["num_decode_tokens"], st["num_prefill_tokens"]] for st in p["steps"]]).reshape(-1, 3)
        predicted[name] = {"busy_s": sum(st["duration_s"] for st in p["steps"]), "predicted_busy_s": float((px @ coef).sum()),
                           "num_steps": len(p["steps"])}
    w, cap = results["workload"], results["settings"]["max_num_seqs"]
    ideal_steps = math.ceil(w["output_tokens"] / cap)
    ideal_busy = ideal_steps * fixed + per_decode * w["output_tokens"] + per_prefill * w["prompt_tokens"]
    out = {"fixed_ms": fixed * 1000, "per_decode_token_ms": per_decode * 1000, "per_prompt_token_ms": per_prefill * 1000,
           "r2": r2, "policies": predicted, "ideal_continuous": {"num_steps": ideal_steps, "busy_s": ideal_busy}}
    bound_s = ideal_busy
    if w.get("requests"):
        requests, budget = [tuple(r) for r in w["requests"]], results["settings"]["max_num_batched_tokens"]
        out["makespan_bound"] = makespan_lower_bound(requests, fixed, per_decode, per_prefill, cap, budget)
        bound_s = out["makespan_bound"]["bound_s"]
        # each policy against the bound at its own step costs: the machine's speed drifts between the
        # policies' runs (measured here: a step's fixed cost 22 ms in one, 29 ms in the next), which
        # the pooled fit averages away but a policy's own steps record
        own = {}
        for name, p in results["policies"].items():
            f = fit_step_cost(p["steps"])
            if f is not None:
                b = makespan_lower_bound(requests, f[0], f[1], f[2], cap, budget)["bound_s"]
                own[name] = {"fixed_ms": f[0] * 1000, "per_decode_token_ms": f[1] * 1000, "per_prompt_token_ms": f[2] * 1000,
                             "r2": f[3], "bound_s": b, "share_of_bound": b / p["summary"]["makespan_s"]}
        out["own_fits"] = own
    if "static" in predicted:
        s = predicted["static"]
        # no policy can finish before the bound: static's makespan over it bounds the throughput ratio
        out["throughput_bound_vs_static"] = results["policies"]["static"]["summary"]["makespan_s"] / bound_s
        out["fixed_only_bound_vs_static"] = s["num_steps"] / ideal_steps
        out["prompt_share_of_static_busy"] = per_prefill * w["prompt_tokens"] / s["busy_s"]
    return out


def cost_model_lines(results: dict[str, Any]) -> list[str]:
    m = step_cost_model(results)
    if m is None:
        return []
    lines = ["| policy | steps | engine busy (s) | model's prediction (s) |", "|---|---:|---:|---:|"]
    lines += [f"| {name} | {p['num_steps']} | {p['busy_s']:.1f} | {p['predicted_busy_s']:.1f} |" for name, p in m["policies"].items()]
    ideal = m["ideal_continuous"]
    lines.append(f"| ideal continuous (every decode step full) | {ideal['num_steps']} | – | {ideal['busy_s']:.1f} |")
    lines += ["", f"Fit over all {sum(p['num_steps'] for p in m['policies'].values())} steps (R² {m['r2']:.2f}): a step costs "
              f"**{m['fixed_ms']:.1f} ms fixed + {m['per_decode_token_ms']:.2f} ms per decoding sequence + "
              f"{m['per_prompt_token_ms']:.2f} ms per prompt token**."]
    if "throughput_bound_vs_static" in m:
        bound = m["throughput_bound_vs_static"]
        measured = results.get("comparison", {}).get("continuous", {}).get("output_tok_s_ratio")
        mb = m.get("makespan_bound")
        if mb:
            why = (f"no admission policy can finish this trace in less than **{mb['bound_s']:.1f} s** from its first arrival "
                   f"(the larger of two bounds: the work bound, {mb['work_bound_s']:.1f} s, any arrival time plus the work "
                   f"arriving from then on, run in full steps; the chain bound, {mb['chain_bound_s']:.1f} s, a request's arrival "
                   f"plus its own steps one after the other plus the rest of the trace's work that cannot run before it "
                   f"arrives), so none can reach more than **{bound:.2f}x** static's throughput (static's makespan over that)")
        else:
            why = (f"no admission policy can reach more than **{bound:.2f}x** static's throughput (static's makespan over the "
                   f"ideal batcher's engine time)")
        lines += ["", f"On this machine {why}: the ideal batcher saves only fixed costs, and still pays for every "
                  f"decoding sequence and prompt token (the prompt tokens alone are {m['prompt_share_of_static_busy']:.0%} of "
                  f"static's engine time)."
                  + (f" Continuous batching measured {measured:.2f}x, **{measured / bound:.0%} of that bound**." if measured else "")
                  + f" Were the fixed cost all there is (a decode step memory-bound, as on a GPU), the bound would be "
                  f"static's step count over the ideal's: {m['fixed_only_bound_vs_static']:.2f}x."]
    own = m.get("own_fits")
    if own:
        lines += ["", "Each policy against the bound at its own step costs (the model fitted to that policy's steps alone: the "
                  "machine's speed drifts between the policies' runs, and a policy's own steps record the speed it ran at):", "",
                  "| policy | fixed (ms) | per decoding sequence (ms) | per prompt token (ms) | R² | shortest makespan at these costs (s) | "
                  "measured makespan (s) | share of the bound |", "|---|---:|---:|---:|---:|---:|---:|---:|"]
        lines += [f"| {name} | {f['fixed_ms']:.1f} | {f['per_decode_token_ms']:.2f} | {f['per_prompt_token_ms']:.2f} | {f['r2']:.2f} | "
                  f"{f['bound_s']:.1f} | {results['policies'][name]['summary']['makespan_s']:.1f} | **{f['share_of_bound']:.0%}** |"
                  for name, f in own.items()]
    return lines


def _busy_ms_per_token(s: dict) -> float:
    """Engine time (sum of step durations, prefill included) per output token."""
    return 1000 * s["mean_step_s"] * s["num_steps"] / s["output_tokens"] if s["output_tokens"] else 0.0


def _longest(policy: dict) -> dict | None:
    done = [r for r in policy["requests"] if r["finished_s"] is not None]
    return max(done, key=lambda r: (r["num_output_tokens"], -r["arrival_s"]), default=None)


def explanation(results: dict[str, Any]) -> list[str]:
    """What this run's own measurements say about why (worded from the numbers, whichever way they fall)."""
    pol = {k: v["summary"] for k, v in results["policies"].items()}
    w = results["workload"]
    lines = []
    if "continuous" in pol and "static" in pol:
        c, s = pol["continuous"], pol["static"]
        cost = decode_step_cost(results)
        ms_s, ms_c = _busy_ms_per_token(s), _busy_ms_per_token(c)
        text = (f"All policies computed the same {w['prompt_tokens']} prompt and {w['output_tokens']} output tokens with the "
                f"same kernels; throughput differs only through how full the steps were and how long the engine was busy "
                f"(≥ {min(p['busy_fraction'] for p in pol.values()):.0%} of each makespan here). Continuous batching ran a "
                f"time-weighted {c['time_weighted_batch_size']:.1f} sequences per step against static's "
                f"{s['time_weighted_batch_size']:.1f}, in {c['num_steps']} steps against {s['num_steps']}, i.e. "
                f"{ms_c:.0f} ms of engine time per output token against {ms_s:.0f} ms ({ms_s / ms_c:.2f}x).")
        if len(cost) >= 2:
            lo, hi = cost[0], cost[-1]
            text += (f" That is what batching can buy on this machine: a pure-decode step cost {lo['median_ms_per_token']:.0f} ms "
                     f"per sequence with {lo['batch']} sequences and {hi['median_ms_per_token']:.0f} ms with {hi['batch']} "
                     f"({lo['median_ms_per_token'] / hi['median_ms_per_token']:.1f}x less)")
            mid = cost[1:-1]
            if mid:
                text += ", and " + ", ".join(f"{r['median_ms_per_token']:.0f} ms with {r['batch']}" for r in mid)
            text += (". A step's fixed cost (streaming the weights, per-operator overhead) is shared by its sequences, but "
                     "each decoding sequence and each prompt token adds compute of its own, which no policy saves: the "
                     "step-cost model below puts numbers on both and bounds the ratio.")
        lines.append(text)
        longest = _longest(results["policies"]["continuous"])
        if longest is not None and c["makespan_s"] > 0:
            span = longest["finished_s"] - longest["arrival_s"]
            lines.append(
                f"A finite trace also bounds continuous batching by its longest request: request {longest['index']} "
                f"({longest['num_output_tokens']} output tokens) needs that many sequential decode steps, which under "
                f"continuous batching (shared with the others) took {span:.0f} s of the {c['makespan_s']:.0f} s makespan. "
                f"The more total work a trace has per longest request (more requests, or shorter long outputs), the more "
                f"of continuous batching's capacity shows in its throughput.")
        lines.append(
            f"Static and dynamic batching run a batch until its longest member finishes: with output lengths from "
            f"{w['output_len']['min']} to {w['output_len']['max']} tokens most slots sit empty for most of a batch's life, and "
            f"requests that arrive meanwhile wait for the whole batch (static TTFT p50 {_f(s['ttft_p50_s'])} s, of which "
            f"queueing p50 {_f(s['queue_p50_s'])} s). Continuous batching admits arrivals at the next step (their prompt "
            f"chunks share steps with running decodes) and refills a slot as soon as a request finishes (TTFT p50 "
            f"{_f(c['ttft_p50_s'])} s, queueing p50 {_f(c['queue_p50_s'])} s): the TTFT gap does not depend on how cheap "
            f"a full step is, the throughput gap does.")
    if "dynamic" in pol and "static" in pol:
        d, s = pol["dynamic"], pol["static"]
        lines.append(
            f"Dynamic batching starts a batch as soon as the engine is idle instead of waiting up to "
            f"{results['settings'].get('static_timeout_s', 0):g} s for a full one, but it still closes admission while a "
            f"batch runs (TTFT p50 {_f(d['ttft_p50_s'])} s vs static {_f(s['ttft_p50_s'])} s, mean batch "
            f"{d['mean_batch_size']:.1f} vs {s['mean_batch_size']:.1f}, throughput {d['output_tok_s']:.1f} vs "
            f"{s['output_tok_s']:.1f} tok/s).")
    variants = [k for k in pol if k.startswith("static-b")]
    if variants and "continuous" in pol:
        c = pol["continuous"]
        parts = [f"{k} (batch {pol[k]['engine']['batch_size']}): {pol[k]['output_tok_s']:.1f} tok/s, continuous "
                 f"{c['output_tok_s'] / pol[k]['output_tok_s']:.2f}x its throughput, TTFT p50 {_f(pol[k]['ttft_p50_s'])} s"
                 for k in variants if pol[k]["output_tok_s"]]
        lines.append("The static baseline above uses the same batch cap as continuous batching (its best case when "
                     "requests queue). Static batching with a smaller fixed batch, as request-level servers often run it: "
                     + "; ".join(parts) + ".")
    lines.append(
        "Throughput is over the makespan (first arrival → last finish) of an open-loop trace: a policy that keeps up "
        "with arrivals is bounded by the offered load, so the ratio also grows with the arrival rate until continuous "
        "batching saturates too.")
    return lines


def admission(results: dict[str, Any]) -> str:
    parts = []
    for name, p in results["policies"].items():
        e = p["summary"].get("engine", {})
        if e.get("batching") == "static":
            parts.append(f"{name} waits for a batch of {e['batch_size']} (at most {e['batch_timeout_s']:g} s) and runs it to completion")
        elif e.get("batching") == "dynamic":
            parts.append(f"{name} takes up to {e['batch_size']} waiting requests when idle and runs them to completion")
        elif e.get("batching") == "continuous":
            parts.append(f"{name} admits at every step")
    return "; ".join(parts)


def render_markdown(results: dict[str, Any], png_names: dict[str, str]) -> str:
    w, st, m = results["workload"], results["settings"], results["machine"]
    lines = ["# Batching study (W2): static vs dynamic vs continuous on one trace", "",
             "Produced by (one run, all policies):", "", "```bash", results["command"], "```", "",
             f"{results['date']}, {results['duration_s']:.0f} s in all; {m['cpu']}, {m['logical_cores']} cores, torch {m['torch']} "
             f"({m['torch_threads']} thread(s)), git {m['git']}.", "",
             "## Workload", "",
             f"- {w['num_requests']} requests, Poisson arrivals at {w['rate_per_s']:g}/s (seed {w['seed']}) over "
             f"{w['arrival_span_s']:.1f} s; classes {w['classes']}"
             + (f"; the rate is {w['calibration']['load']:g} x the capacity calibrated first in this run "
                f"({w['calibration']['capacity_req_s']:.2f} req/s: what full steps sustain at the step cost fitted to "
                f"continuous batching over {w['calibration']['requests']} of the trace's requests arriving at once)"
                if w.get("calibration") else ""),
             f"- prompt tokens {w['prompt_len']['min']}–{w['prompt_len']['max']} (mean {w['prompt_len']['mean']:.0f}), "
             f"output tokens {w['output_len']['min']}–{w['output_len']['max']} (mean {w['output_len']['mean']:.0f}; exact: "
             f"greedy with ignore_eos); random token ids; {w['prompt_tokens']} prompt + {w['output_tokens']} output tokens",
             f"- engine: SmolLM2-135M-Instruct, {st['dtype']}, CPU, in-process `AsyncLLMEngine`; every policy "
             f"`max_num_seqs={st['max_num_seqs']}`, `max_num_batched_tokens={st['max_num_batched_tokens']}`, chunked prefill, "
             f"prefix caching off; admission: {admission(results)}", "",
             "## Results", ""]
    lines += headline_table(results)
    lines += ["", "TTFT and e2e: engine clock, arrival → first token / last token. Throughput: over the makespan.", "",
              "## Targets (2 CPU cores)", ""]
    lines += targets(results)
    lines += ["", "## Why", ""]
    for para in explanation(results):
        lines += [para, ""]
    model = cost_model_lines(results)
    if model:
        lines += ["## Step-cost model: the bound on this machine", ""] + model + [""]
    lines += ["## Diagnostics", "",
              "| policy | makespan (s) | steps | mean step (ms) | time-weighted batch | max batch | engine busy | process CPU (cores) | "
              "load avg 1m start→end | preemptions | max send lag (ms) |",
              "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for name, p in results["policies"].items():
        s = p["summary"]
        lines.append(f"| {name} | {s['makespan_s']:.1f} | {s['num_steps']} | {s['mean_step_s'] * 1000:.0f} | "
                     f"{s['time_weighted_batch_size']:.1f} | {s['max_batch_size']} | {s['busy_fraction']:.0%} | "
                     f"{s['process_cpu_cores']:.2f} | {s['load_avg_1m_at_start']:.1f}→{s['load_avg_1m_at_end']:.1f} | "
                     f"{s['num_preemptions']} | {s['max_arrival_lag_s'] * 1000:.0f} |")
    cost = decode_step_cost(results)
    if cost:
        lines += ["", "Pure-decode step cost by batch size (all policies' steps):", "",
                  "| sequences in the step | steps | median step (ms) | per sequence (ms) |", "|---|---:|---:|---:|"]
        lines += [f"| {r['batch']} | {r['num_steps']} | {r['median_ms']:.0f} | {r['median_ms_per_token']:.1f} |" for r in cost]
    cores = [p["summary"]["process_cpu_cores"] for p in results["policies"].values()]
    loads = [p["summary"]["load_avg_1m_at_start"] for p in results["policies"].values()]
    lines += ["", f"This run's process got {min(cores):.2f}–{max(cores):.2f} of a core (CPU time / wall time; the "
              f"machine's 1-minute load average was {min(loads):.1f}–{max(loads):.1f} on {m['logical_cores']} cores): "
              "step costs, and how they grow with the batch, depend on that share."]
    lines += ["", "Policies run one after another, so a change in the machine's load between them shows in the "
              "load-average and process-CPU columns; compare ratios from one run, not absolute numbers across runs.", ""]
    if png_names:
        lines += ["## Figures", ""]
        if "timeline" in png_names:
            lines += ["Timeline (each row one request, by arrival; grey: waiting in the queue, orange: prefill, blue: decode):",
                      "", f"![timeline]({png_names['timeline']})", ""]
        if "batch_size" in png_names:
            lines += ["Batch size per step over time (and the waiting queue):", "", f"![batch size]({png_names['batch_size']})", ""]
    return "\n".join(lines)


# ---- plots -------------------------------------------------------------------------------------------
def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def draw_timeline(ax, policy: dict, title: str, x_max: float) -> None:
    from matplotlib.patches import Patch

    requests = sorted(policy["requests"], key=lambda r: r["index"])
    segments = timeline_segments(_steps(policy))
    for r in requests:
        y = r["index"]
        start = r["arrival_s"]
        queued_until = r["first_scheduled_s"] if r["first_scheduled_s"] is not None else (r["finished_s"] or x_max)
        ax.broken_barh([(start, max(queued_until - start, 1e-3))], (y - 0.4, 0.8), color=COLORS["queue"], linewidth=0)
        for kind in ("prefill", "decode"):
            spans = [(s, e - s) for s, e, k in segments.get(r["request_id"], ()) if k == kind]
            if spans:
                ax.broken_barh(spans, (y - 0.4, 0.8), color=COLORS[kind], linewidth=0)
    ax.set_xlim(0, x_max)
    ax.set_ylim(len(requests) - 0.5, -0.5)
    ax.set_ylabel("request (by arrival)")
    ax.set_title(title, fontsize=10, loc="left")
    ax.legend(handles=[Patch(color=COLORS[k], label=k if k != "queue" else "queued") for k in ("queue", "prefill", "decode")],
              loc="upper right", fontsize=7, ncol=3)


def _x_max(results: dict[str, Any]) -> float:
    return max((p["summary"]["makespan_s"] for p in results["policies"].values()), default=1.0) * 1.02 + 0.5


def _label(name: str, s: dict) -> str:
    return (f"{name}: {s['output_tok_s']:.1f} output tok/s, TTFT p50 {_f(s['ttft_p50_s'], '.1f')} s, "
            f"mean batch {s['mean_batch_size']:.1f}, makespan {s['makespan_s']:.0f} s")


def plot_timelines(results: dict[str, Any], path: Path) -> None:
    plt = _plt()
    names = list(results["policies"])
    height = max(2.5, 0.09 * results["workload"]["num_requests"] + 1)
    fig, axes = plt.subplots(len(names), 1, figsize=(11, height * len(names)), sharex=True, squeeze=False)
    x_max = _x_max(results)
    for ax, name in zip(axes[:, 0], names, strict=True):
        draw_timeline(ax, results["policies"][name], _label(name, results["policies"][name]["summary"]), x_max)
    axes[-1, 0].set_xlabel("time since the first arrival (s)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def plot_timeline(results: dict[str, Any], name: str, path: Path) -> None:
    plt = _plt()
    height = max(2.5, 0.09 * results["workload"]["num_requests"] + 1)
    fig, ax = plt.subplots(figsize=(11, height))
    draw_timeline(ax, results["policies"][name], _label(name, results["policies"][name]["summary"]), _x_max(results))
    ax.set_xlabel("time since the first arrival (s)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def plot_batch_sizes(results: dict[str, Any], path: Path) -> None:
    plt = _plt()
    names = list(results["policies"])
    fig, axes = plt.subplots(len(names), 1, figsize=(11, 2.2 * len(names) + 0.6), sharex=True, sharey=True, squeeze=False)
    for ax, name in zip(axes[:, 0], names, strict=True):
        steps = results["policies"][name]["steps"]
        s = results["policies"][name]["summary"]
        t = [st["start_s"] for st in steps] + ([steps[-1]["start_s"] + steps[-1]["duration_s"]] if steps else [])
        seqs = [st["num_seqs"] for st in steps] + ([0] if steps else [])
        waiting = [st["num_waiting"] for st in steps] + ([0] if steps else [])
        ax.step(t, seqs, where="post", color="tab:blue", label="sequences in the step")
        ax.fill_between(t, seqs, step="post", alpha=0.25, color="tab:blue")
        ax.step(t, waiting, where="post", color="tab:red", linestyle="--", linewidth=1, label="waiting after the step")
        ax.set_title(f"{name}: mean batch {s['mean_batch_size']:.1f} per step, {s['time_weighted_batch_size']:.1f} time-weighted",
                     fontsize=10, loc="left")
        ax.set_ylabel("requests")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, loc="upper right")
    axes[-1, 0].set_xlabel("time since the first arrival (s)")
    axes[-1, 0].set_xlim(0, _x_max(results))
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def write_reports(results: dict[str, Any], out_dir: Path, raw_path: Path | None = None) -> list[Path]:
    """Write batching.{json,md} and the PNGs into `out_dir` (+ the full data to `raw_path`); returns the paths."""
    out_dir.mkdir(parents=True, exist_ok=True)
    pngs = {"timeline": out_dir / "batching_timeline.png", "batch_size": out_dir / "batching_batch_size.png"}
    plot_timelines(results, pngs["timeline"])
    plot_batch_sizes(results, pngs["batch_size"])
    per_policy = []
    for name in results["policies"]:
        path = out_dir / f"batching_timeline_{name}.png"
        plot_timeline(results, name, path)
        per_policy.append(path)
    md = out_dir / "batching.md"
    md.write_text(render_markdown(results, {k: p.name for k, p in pngs.items()}))
    js = out_dir / "batching.json"
    js.write_text(json.dumps(compact(results), indent=1) + "\n")
    paths = [js, md, *pngs.values(), *per_policy]
    if raw_path is not None:
        raw_path.parent.mkdir(parents=True, exist_ok=True)
        raw_path.write_text(json.dumps(results) + "\n")
        paths.append(raw_path)
    return paths
