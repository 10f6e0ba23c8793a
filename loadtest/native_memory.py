"""Where the native engine's resident memory goes, phase by phase, on W1's shape.

Builds the engine the way `ModelRunner` does, one phase at a time (torch import, weights, packed
weights, C++ kernels, KV cache, then W1: 64 requests x 128 random prompt tokens x 128 output tokens),
printing RSS and its high-water mark after each; the C++ kernel build (a compiler child process on a
cold cache) is reported separately. One process, nothing else loaded.

    .venv/bin/python loadtest/native_memory.py [--dtype bfloat16] [--kv-cache-gib 1] [--out reports/native_memory.json]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import time
from pathlib import Path


def rss_mib() -> tuple[float, float]:
    """(VmRSS, VmHWM) of this process in MiB."""
    fields = dict(line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines() if ":" in line)
    return int(fields["VmRSS"].split()[0]) / 1024, int(fields["VmHWM"].split()[0]) / 1024


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="models/smollm2-135m-instruct")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--kv-cache-gib", type=float, default=1.0)
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--out", help="also write the phases as JSON here")
    args = p.parse_args()
    phases: list[dict] = []

    def mark(name: str) -> None:
        rss, hwm = rss_mib()
        children = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024
        phases.append({"phase": name, "rss_mib": round(rss), "peak_rss_mib": round(hwm), "children_peak_mib": round(children)})
        print(f"{name:<34} RSS {rss:7.0f} MiB   peak {hwm:7.0f} MiB   child processes' peak {children:6.0f} MiB", flush=True)

    mark("python")
    import torch

    torch.manual_seed(0)
    mark("import torch")
    from serve_app.engine import LLM, SamplingParams

    mark("import serve_app.engine")
    started = time.monotonic()
    llm = LLM(args.model, dtype=args.dtype, kv_cache_memory_gib=args.kv_cache_gib, max_num_seqs=64)
    mark(f"engine built ({time.monotonic() - started:.0f} s)")
    runner = llm.engine.core.model_runner
    weights = sum(t.numel() * t.element_size() for t in runner.model.parameters())
    weights += 0 if runner.model._lm_head_packed is None else runner.model._lm_head_packed.numel() * 2
    print(f"  weights {weights / 2**20:.0f} MiB, KV cache {runner.kv_cache_bytes / 2**20:.0f} MiB (allocated, touched as used)")
    vocab = runner.args.vocab_size
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(100, vocab, (args.prompt_len,), generator=gen).tolist() for _ in range(args.num_requests)]
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    started = time.monotonic()
    llm.generate(prompts, params)
    mark(f"W1 run ({time.monotonic() - started:.0f} s)")
    llm.generate(prompts, params)
    mark("W1 run again")
    if args.out:
        load = os.getloadavg()
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps({"args": vars(args), "loadavg_at_end": load, "weights_mib": weights / 2**20,
                                              "kv_cache_mib": runner.kv_cache_bytes / 2**20, "phases": phases}, indent=1))


if __name__ == "__main__":
    main()
