"""Per-op time breakdown of the engine's steps at W1's shapes (torch.profiler), fused ops on and off.

Two steps of the model runner alone, as W1 has them: a decode step of 64 sequences at context 192 (the
middle of W1's decodes) and a prefill step of 16 prompts x 128 tokens (W1's 2,048-token budget). For
each, `--steps` profiled steps after warm-up: every op's self CPU time and calls per step and its share of
the step's wall time (the C++ extension's ops appear as `cpp::*`), with the fused layer ops (residual add
+ RMSNorm, RoPE + K/V write) on and off; the configurations alternate, each keeping its fastest round.
Then, without the profiler, where each step's wall time goes: the step timed whole, then with the
projections, the attention kernels and the fused layer ops replaced by no-ops one after another.

    python -m loadtest.profile_step                # -> reports/profile_cpu.{md,json}
    python -m loadtest.profile_step --quick        # -> build/profile-quick/
"""

from __future__ import annotations

import argparse
import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile, record_function

from loadtest import report
from loadtest.compute_floor import matmul_rate, token_flops
from loadtest.decode_sweep import decode_batch
from loadtest.report import table
from loadtest.stats import percentile
from serve_app.config import EngineConfig
from serve_app.engine.model_runner import ModelRunner
from serve_app.engine.outputs import ScheduledRequest, SchedulerOutput
from serve_app.types import SamplingParams


def prefill_batch(num_prompts: int, prompt_len: int, block_size: int, first_block: int) -> SchedulerOutput:
    nb = -(-prompt_len // block_size)
    greedy = SamplingParams(temperature=0.0, max_tokens=128, ignore_eos=True)
    scheduled = tuple(
        ScheduledRequest(f"p{i}", tuple(range(100, 100 + prompt_len)), 0, tuple(range(first_block + i * nb, first_block + (i + 1) * nb)),
                         True, True, greedy, None)
        for i in range(num_prompts)
    )
    return SchedulerOutput(scheduled, num_prompts * prompt_len)


def labeled(name: str, fn):
    """The C++ extension's ops are not dispatcher ops: name them for the profiler."""
    if fn is None:
        return None

    def call(*args):
        with record_function(name):
            return fn(*args)

    return call


def breakdown(runner: ModelRunner, batch: SchedulerOutput, steps: int, top: int) -> dict:
    for _ in range(2):
        runner.execute_model(batch)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        t0 = time.perf_counter()
        for _ in range(steps):
            runner.execute_model(batch)
        wall = (time.perf_counter() - t0) / steps
    events = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)
    ops = [{"op": e.key, "ms_per_step": e.self_cpu_time_total / 1e3 / steps, "calls_per_step": e.count / steps,
            "share": e.self_cpu_time_total / 1e6 / steps / wall} for e in events[:top]]
    calls = sum(e.count for e in events) / steps
    # what no op accounts for: Python, dispatch, allocation, and the profiler's own cost
    outside = wall * 1e3 - sum(e.self_cpu_time_total for e in events) / 1e3 / steps
    return {"step_ms": wall * 1e3, "op_calls_per_step": calls, "outside_ops_ms": outside, "ops": ops}


def median_step_ms(runner: ModelRunner, batch: SchedulerOutput, steps: int) -> float:
    for _ in range(2):
        runner.execute_model(batch)
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        runner.execute_model(batch)
        times.append(time.perf_counter() - t0)
    return percentile(times, 0.5) * 1e3


def decompose(runner: ModelRunner, batch: SchedulerOutput, steps: int) -> dict:
    """Where a step's wall time goes, without the profiler's own cost: the step is timed whole, then
    with its parts replaced by no-ops one after another (the projections and the lm_head by their
    first outputs, cached; then the attention kernels; then RoPE + K/V write and add + RMSNorm), each
    part's cost being what removing it saved. The outputs are meaningless once parts are gone; only the
    times are used. Everything is restored afterwards."""
    model = runner.model
    saved_runner = {k: getattr(runner, k) for k in ("decode_kernel", "prefill_kernel")}
    saved_model = {k: getattr(model, k) for k in ("_linears", "_rope_write_kv_op", "_add_rms_norm_op")}
    memo: dict = {}

    def cached(fn):  # the first output per (rows, weight): the same shapes, no matmul
        def call(*args):
            key = (fn, args[0].shape[0], *(id(a) for a in args[1:2]))
            if key not in memo:
                memo[key] = fn(*args)
            return memo[key]
        return call

    def no_op(*args):
        return None

    def no_projections():
        model._linears = {name: cached(fn) for name, fn in saved_model["_linears"].items()}
        model.compute_logits = cached(type(model).compute_logits.__get__(model))

    def no_attention():
        runner.decode_kernel = saved_runner["decode_kernel"] and no_op
        runner.prefill_kernel = saved_runner["prefill_kernel"] and no_op

    def no_layer_ops():
        model._rope_write_kv_op = saved_model["_rope_write_kv_op"] and no_op
        model._add_rms_norm_op = saved_model["_add_rms_norm_op"] and (lambda x, residual, weight, eps: x)

    matmuls = "C++ bf16 kernels, SiLU·mul fused" if runner.linear_impl == "kernels" else "oneDNN bf16 matmuls"
    stages = [("the whole step", lambda: None), (f"projections and lm_head ({matmuls})", no_projections),
              ("attention kernels", no_attention), ("RoPE + K/V write, residual add + RMSNorm (C++ ops)", no_layer_ops)]
    times = []
    try:
        for _, remove in stages:
            remove()
            times.append(median_step_ms(runner, batch, steps))
    finally:
        for k, v in saved_runner.items():
            setattr(runner, k, v)
        for k, v in saved_model.items():
            setattr(model, k, v)
        vars(model).pop("compute_logits", None)
    parts = [{"part": name, "ms_per_step": before - after} for (name, _), before, after in zip(stages[1:], times, times[1:], strict=False)]
    silu = "" if model._silu_mul_linear else "SiLU·mul, "  # else fused into the gate/up matmul, counted with it
    parts.append({"part": f"the rest: {silu}embedding, input preparation, sampling, Python", "ms_per_step": times[-1]})
    return {"step_ms": times[0], "parts": parts}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="models/smollm2-135m-instruct")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--top", type=int, default=15)
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    p.add_argument("--out-dir")
    p.add_argument("--quick", action="store_true", help="3 steps, decode batch 16, prefill 4 x 128")
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    steps, decode_b, prefill_n = (3, 16, 4) if args.quick else (args.steps, 64, 16)
    cfg = EngineConfig.from_kwargs(args.model, dtype="bfloat16", num_blocks=decode_b * 12 + prefill_n * 8 + 1)
    runner = ModelRunner(cfg.model, cfg.cache, cfg.model.hf_config(), cfg.scheduler)
    model = runner.model
    model._rms_norm_op = labeled("cpp::rms_norm", model._rms_norm_op)
    if runner.linear_impl == "kernels":  # the C++ projections (else oneDNN's, a dispatcher op the profiler names)
        model._linears = {name: labeled("cpp::linear_silu_mul" if name == "gate_up" else "cpp::linear", fn)
                          for name, fn in model._linears.items()}
        model._logits_linear = labeled("cpp::linear_logits", model._logits_linear)
    runner.decode_kernel = labeled("cpp::paged_decode", runner.decode_kernel)
    runner.prefill_kernel = labeled("cpp::paged_prefill", runner.prefill_kernel)
    runner.argmax = labeled("cpp::argmax", runner.argmax)
    # the fused layer ops, turned off together for the "unfused" rounds (each then runs as the torch ops it replaces)
    fused_ops = {"_add_rms_norm_op": labeled("cpp::add_rms_norm", model._add_rms_norm_op),
                 "_rope_write_kv_op": labeled("cpp::rope_write_kv", model._rope_write_kv_op)}
    shapes = {"decode": decode_batch(decode_b, 192, 16), "prefill": prefill_batch(prefill_n, 128, 16, decode_b * 12)}
    result = report.start("profile_step")
    result.update(threads=torch.get_num_threads(), decode_batch=decode_b, prefill=f"{prefill_n} x 128", runs={})
    # alternate the two configurations and keep each one's fastest round: the machine is shared
    for _ in range(1 if args.quick else 2):
        for name, batch in shapes.items():
            for fused in (True, False):
                for attr, op in fused_ops.items():
                    setattr(model, attr, op if fused else None)
                key = f"{name} ({'fused' if fused else 'unfused'})"
                run = breakdown(runner, batch, steps, args.top)
                print(f"[profile] {key}: {run['step_ms']:.1f} ms/step, {run['op_calls_per_step']:.0f} op calls/step", flush=True)
                if key not in result["runs"] or run["step_ms"] < result["runs"][key]["step_ms"]:
                    result["runs"][key] = run
    for attr, op in fused_ops.items():
        setattr(model, attr, op)
    result["decomposed"] = {}
    hf_cfg = cfg.model.hf_config()
    per_token, head, _ = token_flops(hf_cfg)
    for name, batch in shapes.items():
        result["decomposed"][name] = run = decompose(runner, batch, steps)
        # the same matmuls at the compute floor's rate (loadtest/compute_floor.py: one layer's weights, hot in cache)
        rows, sampled = batch.num_batched_tokens, len(batch.scheduled)
        rate = matmul_rate(hf_cfg, rows, "bfloat16", "cpu", with_head=name == "decode")
        run["projections_at_floor_rate_ms"] = (rows * per_token + sampled * head) / rate * 1e3
        print(f"[profile] {name} without the profiler: {run['step_ms']:.1f} ms/step; "
              + ", ".join(f"{p['part'].split(' (')[0]} {p['ms_per_step']:.1f}" for p in run["parts"]), flush=True)
    lines = [f"{result['threads']} torch threads; other processes share the cores: shares are of wall time. Self CPU time per op, per step.", ""]
    for key, run in result["runs"].items():
        lines += [f"## {key}: {run['step_ms']:.1f} ms/step, {run['op_calls_per_step']:.0f} op calls/step", ""] + table(
            ["op", "ms/step", "calls/step", "share of step"],
            [[f"`{o['op']}`", f"{o['ms_per_step']:.2f}", f"{o['calls_per_step']:.0f}", f"{100 * o['share']:.1f}%"] for o in run["ops"]])
        lines += [f"Outside every op (Python, dispatch, allocation, the profiler's own cost): {run['outside_ops_ms']:.1f} ms/step "
                  f"({100 * run['outside_ops_ms'] / run['step_ms']:.0f}%).", ""]
    lines += ["## Where a step's time goes, without the profiler", "", "Each fused step timed whole (median), then with its parts replaced "
              "by no-ops one after another: a part's cost is what removing it saved.", ""]
    for name, run in result["decomposed"].items():
        lines += [f"### {name}: {run['step_ms']:.1f} ms/step", ""] + table(
            ["part", "ms/step", "share"], [[p["part"], f"{p['ms_per_step']:.1f}", f"{100 * p['ms_per_step'] / run['step_ms']:.0f}%"] for p in run["parts"]])
        lines += [f"The same projections at the compute floor's matmul rate (loadtest/compute_floor.py: one layer's weights, hot in cache): "
                  f"{run['projections_at_floor_rate_ms']:.1f} ms.", ""]
    paths = report.write(result, args.out_dir or ("build/profile-quick" if args.quick else "reports"), "profile_cpu",
                         "Per-op time breakdown of engine steps (CPU, bf16)", lines)
    print(f"[profile] wrote {paths}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
