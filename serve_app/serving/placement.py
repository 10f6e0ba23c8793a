"""Where an LLMServer replica runs: its Ray actor options, and for a multi-device engine the
placement group that reserves its devices.

One device per replica (the default): the replica actor asks for `num_cpus_per_replica` CPUs and
`num_gpus_per_replica` GPUs itself. A vLLM engine with `tensor_parallel_size` x
`pipeline_parallel_size` > 1 ranks (as Ray Serve LLM places it): the replica gets a placement group
of one bundle for itself (its CPUs, no GPU) plus one bundle per rank ({"GPU": 1} on CUDA,
{"CPU": 1} on CPU), packed onto one node (STRICT_PACK: tensor parallelism needs the ranks' fast
interconnect); Ray reserves the whole group before the replica starts. On GPUs vLLM's Ray executor
starts its rank actors in the GPU bundles. On CPU vLLM has no Ray executor: the ranks are processes
of the replica's engine (vLLM's `mp` executor, `backends/vllm_options.py`) on the group's one node,
and their bundles count one of Ray's CPUs per rank on that node (a rank keeps its own cores busy).
"""

from __future__ import annotations

from typing import Any

from serve_app.serving.config import ServeConfig


def replica_placement(config: ServeConfig) -> dict[str, Any]:
    """Keyword arguments for `LLMServer.options(...)`: `ray_actor_options` and, for a multi-rank
    engine, `placement_group_bundles` and `placement_group_strategy`."""
    actor: dict[str, Any] = {"num_cpus": config.num_cpus_per_replica}
    if config.backend_config.device == "cpu":
        # OpenMP reads these once, when torch first loads it: they must be in the process's environment from the start
        env = {"OMP_WAIT_POLICY": config.omp_wait_policy.upper()} if config.omp_wait_policy != "default" else {}
        if config.omp_spin_count >= 0:
            env["GOMP_SPINCOUNT"] = str(config.omp_spin_count)
        if env:
            actor["runtime_env"] = {"env_vars": env}
    ranks = config.backend_config.world_size
    if ranks == 1:
        if config.num_gpus_per_replica:
            actor["num_gpus"] = config.num_gpus_per_replica
        return {"ray_actor_options": actor}
    rank_bundle = {"GPU": 1} if config.backend_config.device != "cpu" else {"CPU": 1}
    return {
        "ray_actor_options": actor,
        "placement_group_bundles": [{"CPU": config.num_cpus_per_replica}] + [dict(rank_bundle) for _ in range(ranks)],
        "placement_group_strategy": "STRICT_PACK",
    }
