"""Structured outputs (docs/structured-outputs.md): 16 chat requests at once, greedy, constrained by one JSON schema
or unconstrained with exactly the constrained token counts (native also with every row masked whole), on the native
engine and vLLM-CPU, each in a worker process, runs interleaved over the repeats; and first-seen schemas' compile time.

    .venv/bin/python -m loadtest.bench_structured [--repeats 5] [--no-vllm]    # reports/structured.*
"""

from __future__ import annotations

import contextlib
import json
import sys
import time
from typing import Any

from loadtest import machine, report
from loadtest.engines import vllm_cpu_env
from loadtest.report import cell, table
from loadtest.stats import interleaved, percentile, spread
from loadtest.worker import Worker, WorkerError
from serve_app.types import StructuredOutput
from tests.recording_logger import RecordingLogger

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 40}, "price_usd": {"type": "integer", "minimum": 1, "maximum": 100000},
    "category": {"enum": ["tools", "kitchen", "garden", "toys", "books", "electronics"]},
    "tags": {"type": "array", "items": {"type": "string", "maxLength": 16}, "minItems": 1, "maxItems": 3}, "in_stock": {"type": "boolean"}},
    "required": ["name", "price_usd", "category", "tags", "in_stock"]}
PRODUCTS = ["a hammer", "a teapot", "a garden hose", "a toy robot", "a cookbook", "headphones", "a drill", "a frying pan", "a rake", "a puzzle",
            "a novel", "a phone charger", "a screwdriver set", "a kettle", "a flower pot", "a kite"]
MAX_TOKENS = 96
MASKED_WHOLE = "native constrained, every row masked whole"
RUNS = {"native constrained": ("native", False, False), "native unconstrained": ("native", True, False), MASKED_WHOLE: ("native", False, True),
        "vllm constrained": ("vllm", False, False), "vllm unconstrained": ("vllm", True, False)}  # label: (engine, unconstrained, mask whole)


class Structured:
    """The worker's object: `opts["engine"]` ("native" or "vllm") on the product prompts, warmed up."""

    def __init__(self, opts: dict[str, Any]) -> None:
        import torch
        from transformers import AutoTokenizer

        torch.set_num_threads(opts["threads"])
        tok = AutoTokenizer.from_pretrained(opts["model"])
        self.ids = [list(tok.apply_chat_template([{"role": "user", "content": f"Describe {p} for an online shop, as JSON."}],
                                                 add_generation_prompt=True, return_dict=True)["input_ids"]) for p in PRODUCTS]
        self.native, self.recorder = opts["engine"] == "native", RecordingLogger()
        if self.native:
            from serve_app.engine import LLM

            self.llm = LLM(opts["model"], dtype="bfloat16", kv_cache_memory_gib=1.0, max_num_seqs=16, stat_loggers=[self.recorder])
            self.masks = self.llm.engine.core.model_runner.masks
        else:
            vllm_cpu_env(1)
            from vllm import LLM

            self.llm = LLM(model=opts["model"], dtype="bfloat16", seed=0, max_num_seqs=16, enforce_eager=True, enable_prefix_caching=False,
                           disable_log_stats=False)
        self.run(None, False, self.ids[:4])  # warm-up (and the schema's first compile)

    def run(self, lengths: list[int] | None, mask_whole: bool = False, ids: list[list[int]] | None = None) -> dict[str, Any]:
        """Constrained (`lengths` None) or exactly `lengths` tokens each unconstrained; native
        `mask_whole`: every constrained row masked whole instead of checking greedy rows' choices."""
        ids = ids or self.ids
        if self.native:
            from serve_app.engine import SamplingParams

            self.llm.reset_prefix_cache()
            self.masks.check_greedy = not mask_whole
            self.recorder.steps.clear()
            constraint, quiet = {"structured": StructuredOutput(json_schema=json.dumps(SCHEMA))}, {}
        else:
            from vllm import SamplingParams
            from vllm.sampling_params import StructuredOutputsParams

            constraint = {"structured_outputs": StructuredOutputsParams(json=json.dumps(SCHEMA), disable_any_whitespace=True)}
            ids, quiet = [{"prompt_token_ids": p} for p in ids], {"use_tqdm": False}
        params = (SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, **constraint) if lengths is None
                  else [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in lengths])
        start = time.perf_counter()
        requests = self.llm.generate(ids, params, **quiet)
        elapsed, outs = time.perf_counter() - start, requests if self.native else [r.outputs[0] for r in requests]
        out = {"elapsed_s": elapsed, "token_ids": [list(o.token_ids) for o in outs], "texts": [o.text for o in outs]}
        if not self.native:
            out["tpot_s"] = [(m.last_token_ts - m.first_token_ts) / (len(o.token_ids) - 1) for r, o in zip(requests, outs, strict=True)
                             if (m := r.metrics) is not None and getattr(m, "last_token_ts", 0) and len(o.token_ids) > 1]
        else:
            masks = [s.grammar_mask_s for s in self.recorder.steps if s.grammar_mask_s is not None]
            out.update(tpot_s=[o.metrics.tpot_s for o in outs if o.metrics.tpot_s is not None],
                       step_s_median=percentile([s.step_duration_s for s in self.recorder.steps], 0.5), mask_s_median=percentile(masks, 0.5))
        return out

    def compile_first_seen(self, count: int) -> list[float]:
        """Compile `count` schemas never seen before (the product schema with a renamed property)."""
        times = []
        for i in range(count):
            schema = json.dumps(SCHEMA).replace("in_stock", f"in_stock_{i}_{time.time_ns()}")
            start = time.perf_counter()
            self.llm.engine.core.grammars.submit(StructuredOutput(json_schema=schema)).result()
            times.append(time.perf_counter() - start)
        return times


def valid(texts: list[str]) -> int:
    import jsonschema

    ok = 0
    for t in texts:
        with contextlib.suppress(ValueError, jsonschema.ValidationError):
            jsonschema.validate(json.loads(t), SCHEMA)
            ok += 1
    return ok


def body(results: dict[str, Any]) -> list[str]:
    med, n, c = results["medians"], len(PRODUCTS), results["native_compile_first_seen_s"]
    return [f"{n} chat requests at once, greedy, bf16; constrained by one JSON schema (max_tokens {MAX_TOKENS}); unconstrained runs "
            "generate exactly the constrained runs' token counts (ignore_eos). Medians over the repeats; the runs take turns, their order "
            "rotated each repeat, and each starts once no core is busy (vLLM-CPU's processes spin about a second after a generate).", ""] + table(
        ["run", "output tokens", "elapsed (s)", "output tok/s", "TPOT median (ms)", "mask per step median (us)", "valid JSON"],
        [[label, f"{v['output_tokens']:.0f}", f"{v['elapsed_s']:.2f}", f"{v['output_tok_s']:.1f}",
          f"{v['tpot_median_s'] * 1e3:.1f}" if v.get("tpot_median_s") else "n/a", f"{v['mask_s_median'] * 1e6:.0f}" if v.get("mask_s_median") else "",
          f"{min(results['valid_outputs'][label])}/{n}" if label in results["valid_outputs"] else ""] for label, v in med.items()]) + [
        "Ratios, paired per repeat (median, min–max):", "", *(f"- {k}: {cell(v, digits=3)}" for k, v in results["ratios"].items()), "",
        f"Native compile of a first-seen schema (compile thread): median {percentile(c, 0.5) * 1e3:.0f} ms over {len(c)} schemas "
        f"(min {min(c) * 1e3:.0f}, max {max(c) * 1e3:.0f})."]


def main(argv: list[str] | None = None) -> int:
    p = report.Parser(__doc__, model=True)
    p.options(repeats=5, threads=2)
    p.add_argument("--no-vllm", action="store_true", help="the native engine alone")
    args, results, workers = p.parse_args(argv), report.start("bench_structured"), {}
    for engine in ("native",) if args.no_vllm else ("native", "vllm"):
        try:
            workers[engine] = Worker("loadtest.bench_structured:Structured", {"model": args.model, "threads": args.threads, "engine": engine}, 600)
        except WorkerError as exc:
            print(f"[bench-structured] {engine} failed to start: {exc}", file=sys.stderr)
    if "native" not in workers:
        return 1
    # the unconstrained runs' token counts: one constrained run's (also the warm-up); greedy native runs (batch-invariant) repeat them
    lengths = {engine: [len(t) for t in w.call("run", None, False)["token_ids"]] for engine, w in workers.items()}
    runs, validity, waited = {}, {}, []
    try:
        for r in range(args.repeats):
            for engine in interleaved(list(workers), r):
                for label in interleaved([name for name, (e, _, _) in RUNS.items() if e == engine], r):
                    _, unconstrained, mask_whole = RUNS[label]
                    waited.append(machine.wait_quiet())
                    res = workers[engine].call("run", lengths[engine] if unconstrained else None, mask_whole)
                    tokens = sum(len(t) for t in res["token_ids"])
                    runs.setdefault(label, []).append({"output_tokens": tokens, "elapsed_s": res["elapsed_s"], "output_tok_s": tokens / res["elapsed_s"],
                                                       "tpot_median_s": percentile(res.get("tpot_s", []), 0.5),
                                                       **{k: res[k] for k in ("mask_s_median", "step_s_median") if k in res}})
                    if not unconstrained:
                        validity.setdefault(label, []).append(valid(res["texts"]))
                    print(f"[bench-structured] repeat {r}: {label}: {runs[label][-1]}", file=sys.stderr, flush=True)
        results["native_compile_first_seen_s"] = workers["native"].call("compile_first_seen", 5)
    finally:
        for w in workers.values():
            w.stop()
    med = {label: {k: percentile([x[k] for x in rs], 0.5) if all(x.get(k) is not None for x in rs) else None for k in rs[0]}
           for label, rs in runs.items()}

    def paired(a: str, b: str, key: str = "output_tok_s") -> dict[str, float] | None:
        return spread(x[key] / y[key] for x, y in zip(runs.get(a, []), runs.get(b, []), strict=False) if x[key] and y[key])

    ratios = {"native constrained / unconstrained output tok/s": paired("native constrained", "native unconstrained"),
              "native constrained / unconstrained TPOT": paired("native constrained", "native unconstrained", "tpot_median_s"),
              "native constrained tok/s, greedy rows checked / every row masked whole": paired("native constrained", MASKED_WHOLE)}
    if "vllm constrained" in med:
        ratios["native constrained / vLLM-CPU constrained output tok/s"] = paired("native constrained", "vllm constrained")
        ratios["vLLM-CPU constrained / unconstrained output tok/s"] = paired("vllm constrained", "vllm unconstrained")
    results["quiet_wait_s"] = spread(waited)
    results.update(schema=SCHEMA, num_requests=len(PRODUCTS), max_tokens=MAX_TOKENS, runs=runs, valid_outputs=validity, medians=med, ratios=ratios)
    paths = report.write(results, args.out_dir, "structured", "Structured outputs: constrained vs unconstrained decoding", body(results),
                         {"structured": report.bars("Output tok/s (median over repeats)", "tok/s", {"": {k: v["output_tok_s"] for k, v in med.items()}})})
    print(paths[1].read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
