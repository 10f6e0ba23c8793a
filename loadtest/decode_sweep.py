"""Decode-step latency sweep: one decode step of the model runner alone at batch sizes 1..256 (median, p10-p90)
beside its memory floor (every weight once plus the batch's K/V over the copy bandwidth measured in the run).

    python -m loadtest.decode_sweep --device cuda --out-dir reports/gpu     # gpu_check.sh runs this; --quick: CPU smoke run
"""

from __future__ import annotations

import time

import torch

from loadtest import report
from loadtest.compute_floor import sync
from loadtest.report import table
from loadtest.stats import percentile
from serve_app.engine.config import EngineConfig
from serve_app.engine.model_runner import ModelRunner, kv_cache_bytes_per_block
from serve_app.engine.outputs import ScheduledRequest, SchedulerOutput
from serve_app.types import SamplingParams


def copy_bandwidth(device: torch.device, nbytes: int) -> float:
    """Bytes/s of a large copy (read + write), best of 5."""
    src = torch.empty(nbytes // 2, dtype=torch.float16, device=device)
    dst, best = torch.empty_like(src), float("inf")
    for _ in range(5):
        sync(device)
        t0 = time.perf_counter()
        dst.copy_(src)
        sync(device)
        best = min(best, time.perf_counter() - t0)
    return 2 * src.numel() * src.element_size() / best


def main() -> None:
    p = report.Parser(__doc__, "build/decode-sweep-quick", model=True, batch_sizes="1,4,16", steps=5, context=64)
    p.options({"context": "tokens of context per request", "steps": "timed steps per batch size", "block_size": "KV block size (tokens)"},
              device="cpu", dtype="bfloat16", batch_sizes="1,2,4,8,16,32,64,128,256", context=256, steps=50, block_size=16)
    p.add_argument("--enforce-eager", action="store_true", help="CUDA: no graphs")
    args = p.parse_args()
    sizes, device = [int(b) for b in args.batch_sizes.split(",")], torch.device(args.device)
    results, nb = report.start("decode_sweep", args.device), -(-args.context // args.block_size)  # KV blocks per request
    cfg = EngineConfig.from_kwargs(args.model, dtype=args.dtype, device=args.device, enforce_eager=args.enforce_eager, max_num_seqs=max(sizes),
                                   block_size=args.block_size, num_blocks=max(sizes) * nb + 1)
    runner = ModelRunner(cfg.model, cfg.cache, cfg.model.hf_config(), cfg.scheduler)
    bandwidth, model = copy_bandwidth(device, 1 << 30 if device.type == "cuda" else 1 << 28), runner.model
    # the weights a decode step streams: not the embedding table (it reads b rows of it) unless the head is tied to it
    w_bytes = sum(w.numel() * w.element_size() for name, w in model.named_parameters() if name != "embed" or model.lm_head is None)
    kv_token = kv_cache_bytes_per_block(runner.args, 1, runner.dtype)
    results.update(device=torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu", dtype=args.dtype, attention_backend=runner.backend,
                   cuda_graphs=runner.decode_graphs is not None, context=args.context, steps=args.steps, block_size=args.block_size,
                   weight_bytes=w_bytes, kv_bytes_per_token=kv_token, copy_bandwidth_gb_s=bandwidth / 1e9, rows=[])
    greedy = SamplingParams(temperature=0.0, max_tokens=1 << 20, ignore_eos=True)
    for b in sizes:  # b requests, each decoding its next token after `context` tokens
        batch, times = SchedulerOutput(tuple(ScheduledRequest(f"r{i}", (100 + i,), args.context - 1, tuple(range(i * nb, (i + 1) * nb)), True, False,
                                                              greedy, None) for i in range(b)), b), []
        for _ in range(3):
            runner.execute_model(batch)
        for _ in range(args.steps):
            sync(device)
            t0 = time.perf_counter()
            runner.execute_model(batch)  # ends with the sampled ids on the host: one sync
            times.append(time.perf_counter() - t0)
        floor_s, med = (w_bytes + b * args.context * kv_token) / bandwidth, percentile(times, 0.5)
        results["rows"].append({"batch": b, "step_ms": med * 1e3, "p10_ms": percentile(times, 0.1) * 1e3, "p90_ms": percentile(times, 0.9) * 1e3,
                                "floor_ms": floor_s * 1e3, "tok_s": b / med, "of_floor": floor_s / med})
        print(f"[sweep] batch {b:4d}: step {med * 1e3:8.3f} ms (floor {floor_s * 1e3:7.3f} ms), {b / med:9.0f} tok/s", flush=True)
    first = results["rows"][0]
    target = [f"Target: a batch-1 decode step ≤ 1 ms with CUDA graphs: {first['step_ms']:.3f} ms → {'met' if first['step_ms'] <= 1 else '**not met**'}.", ""]
    report.write(results, args.out_dir, "decode_sweep", "Decode-step latency sweep", [
        f"{results['device']}, {args.dtype}, attention `{runner.backend}`{', CUDA graphs' if results['cuda_graphs'] else ''}; KV blocks of "
        f"{args.block_size} tokens; context {args.context} tokens per request; median of {args.steps} steps (p10-p90). Floor: (weights "
        f"{w_bytes / 2**20:.0f} MiB + the batch's K/V) / measured copy bandwidth {bandwidth / 1e9:.0f} GB/s.", "",
        *(target if results["cuda_graphs"] and first["batch"] == 1 else [])] + table(
        ["batch", "step (ms)", "p10-p90 (ms)", "floor (ms)", "floor / step", "tok/s"],
        [[r["batch"], f"{r['step_ms']:.3f}", f"{r['p10_ms']:.3f}-{r['p90_ms']:.3f}", f"{r['floor_ms']:.3f}", f"{100 * r['of_floor']:.0f}%", f"{r['tok_s']:.0f}"]
         for r in results["rows"]]), {"decode_sweep": report.lines(
        f"Decode step, {results['device']}, {args.dtype}", "batch size (sequences)", "ms per step", {
            "decode step (median)": [(r["batch"], r["step_ms"]) for r in results["rows"]],
            "weight + KV streaming floor": [(r["batch"], r["floor_ms"]) for r in results["rows"]]}, log="xy")})


if __name__ == "__main__":
    main()
