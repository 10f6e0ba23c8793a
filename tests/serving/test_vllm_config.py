"""`backend: vllm` configuration, in the default suite (vllm need not be installed): options are
validated on the driver with field-named errors, become the right vLLM engine arguments, feed the
router the engine's block size, and nothing here (or in the serving layer) imports vllm."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from serve_app.backends.vllm_options import GIB, VLLMOptions
from serve_app.engine.config import EngineConfig
from serve_app.serving.app import request_router_config
from serve_app.serving.config import ServeConfig

MODEL = "models/smollm2-135m-instruct"
REPO = Path(__file__).resolve().parents[2]


def vllm_config(**engine) -> ServeConfig:
    return ServeConfig(model=MODEL, backend="vllm", engine=engine)


def test_defaults_and_engine_arguments():
    config = vllm_config(enforce_eager=True, max_model_len=2048, kv_cache_memory_gib=0.25, engine_args={"max_logprobs": 0})
    options = config.backend_config.options
    assert (config.backend_config.device, config.backend_config.kv_block_size) == ("cpu", 128)  # vLLM's CPU default block size
    args = options.async_engine_args("/m", "served")
    assert args == {
        "model": "/m", "served_model_name": "served", "dtype": "float32", "seed": 0, "max_num_seqs": 64,
        "max_num_batched_tokens": 2048, "enable_prefix_caching": True, "enforce_eager": True, "disable_log_stats": True,
        "enable_logging_iteration_details": True, "max_model_len": 2048, "kv_cache_memory_bytes": GIB // 4, "max_logprobs": 0,
    }
    assert options.environment() == {"VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}
    assert request_router_config(config).request_router_kwargs["block_size"] == 128


def test_gpu_options():
    options = vllm_config(device="cuda", gpu_memory_utilization=0.85, block_size=32).backend_config.options
    args = options.async_engine_args("/m", "m")
    assert args["gpu_memory_utilization"] == 0.85 and "kv_cache_memory_bytes" not in args and args["block_size"] == 32
    assert options.environment() == {} and options.effective_block_size == 32
    assert VLLMOptions(device="cuda").effective_block_size == 16


@pytest.mark.parametrize(("engine", "field"), [
    ({"num_blocks": 64}, "num_blocks"),  # a native option
    ({"dtype": "int8"}, "dtype"),
    ({"device": "cuda:1"}, "device"),
    ({"max_num_seqs": 0}, "max_num_seqs"),
    ({"block_size": 17}, "block_size"),
    ({"kv_cache_memory_gib": 0}, "kv_cache_memory_gib"),
    ({"gpu_memory_utilization": 0.9}, "gpu_memory_utilization"),  # on CPU
    ({"engine_args": {"enforce_eager": True}}, "engine_args"),  # has its own option
    ({"engine_args": {"kv_cache_memory_bytes": 1}}, "engine_args"),
])
def test_bad_options_name_the_field(engine, field):
    with pytest.raises(ValueError, match=rf"^{field}:"):
        vllm_config(**engine)


def test_backend_names():
    with pytest.raises(ValueError, match=r"^backend:"):
        ServeConfig(model=MODEL, backend="tgi")
    assert isinstance(vllm_config().backend_config.options, VLLMOptions)  # each backend validates its own options
    native = ServeConfig(model=MODEL).backend_config
    assert isinstance(native.options, EngineConfig) and (native.kv_block_size, native.device) == (16, "cpu")


def test_the_serving_layer_and_the_backend_module_never_import_vllm():
    code = (
        "import sys\n"
        "from serve_app.serving.config import ServeConfig\n"
        "from serve_app.backends import make_backend\n"
        "import serve_app.backends.vllm, serve_app.serving.app\n"
        f"backend = make_backend(ServeConfig(model={MODEL!r}, backend='vllm').backend_config)\n"
        "assert type(backend).__name__ == 'VLLMBackend'\n"
        "print(sorted(m for m in sys.modules if m == 'vllm' or m.startswith('vllm.')))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr


def test_tensor_parallel_placement_group():
    """tensor_parallel_size ranks: one bundle for the replica, one device bundle per rank, one node."""
    from serve_app.serving.placement import replica_placement

    config = ServeConfig(model=MODEL, backend="vllm", num_cpus_per_replica=2,
                         engine={"device": "cuda", "tensor_parallel_size": 2, "pipeline_parallel_size": 2})
    assert replica_placement(config) == {
        "ray_actor_options": {"num_cpus": 2},
        "placement_group_bundles": [{"CPU": 2}, {"GPU": 1}, {"GPU": 1}, {"GPU": 1}, {"GPU": 1}],
        "placement_group_strategy": "STRICT_PACK",
    }
    args = config.backend_config.options.async_engine_args("/m", "m")
    assert (args["tensor_parallel_size"], args["pipeline_parallel_size"], args["distributed_executor_backend"]) == (2, 2, "ray")
    cpu = ServeConfig(model=MODEL, backend="vllm", num_cpus_per_replica=0.5, engine={"tensor_parallel_size": 2})
    assert replica_placement(cpu)["placement_group_bundles"] == [{"CPU": 0.5}, {"CPU": 1}, {"CPU": 1}]
    single = ServeConfig(model=MODEL, backend="vllm", num_gpus_per_replica=1, engine={"device": "cuda"})
    assert replica_placement(single) == {"ray_actor_options": {"num_cpus": 0.5, "num_gpus": 1}}
    assert "tensor_parallel_size" not in single.backend_config.options.async_engine_args("/m", "m")
    with pytest.raises(ValueError, match="^num_gpus_per_replica:"):
        ServeConfig(model=MODEL, backend="vllm", num_gpus_per_replica=1, engine={"device": "cuda", "tensor_parallel_size": 2})
    with pytest.raises(ValueError, match="^tensor_parallel_size:"):
        vllm_config(tensor_parallel_size=0)


def test_cpu_ranks_run_on_the_mp_executor_each_pinned_to_its_cores():
    """On CPU several ranks are vLLM `mp` processes (vLLM has no Ray executor there), each rank's
    OpenMP threads bound to its own share of the replica's cores; GPUs keep the Ray executor."""
    from serve_app.backends.vllm_options import split_cores

    tp = VLLMOptions(tensor_parallel_size=3)
    assert tp.async_engine_args("/m", "m")["distributed_executor_backend"] == "mp"
    assert VLLMOptions(device="cuda", tensor_parallel_size=2).async_engine_args("/m", "m")["distributed_executor_backend"] == "ray"
    assert tp.environment(cpus=[1, 0]) == {"VLLM_CPU_NUM_OF_RESERVED_CPU": "0", "VLLM_CPU_OMP_THREADS_BIND": "0|1|0"}
    pp = VLLMOptions(pipeline_parallel_size=2, enforce_eager=False, cpu_reserved_cores=1)
    assert pp.environment(cpus=range(6))["VLLM_CPU_OMP_THREADS_BIND"] == "0,1,2|3,4"  # core 5 kept free
    assert pp.environment(cpus=[0, 1])["VLLM_CPU_OMP_THREADS_BIND"] == "0|0"  # core 1 kept free: the ranks share 0
    assert pp.environment(cpus=[3])["VLLM_CPU_OMP_THREADS_BIND"] == "3|3"  # one core: nothing left to reserve
    assert VLLMOptions(tensor_parallel_size=2, cpu_threads_bind="0-3|4-7").environment(cpus=[0])["VLLM_CPU_OMP_THREADS_BIND"] == "0-3|4-7"
    assert "VLLM_CPU_OMP_THREADS_BIND" not in VLLMOptions().environment(cpus=[0, 1])  # one rank: vLLM's own binding
    assert (split_cores([0, 1, 2, 3, 4], 2), split_cores([7], 2), split_cores([4, 5, 6, 7], 4)) == ("0,1,2|3,4", "7|7", "4|5|6|7")
    for bad, field in [({"tensor_parallel_size": 2, "cpu_threads_bind": "0-3"}, "cpu_threads_bind"),  # one list, two ranks
                       ({"cpu_threads_bind": "cores 0 to 3"}, "cpu_threads_bind"),
                       ({"device": "cuda", "cpu_threads_bind": "auto"}, "cpu_threads_bind"),
                       ({"pipeline_parallel_size": 2, "enforce_eager": True}, "pipeline_parallel_size")]:
        with pytest.raises(ValueError, match=rf"^{field}:"):
            vllm_config(**bad)
    VLLMOptions(device="cuda", pipeline_parallel_size=2, enforce_eager=True)  # GPUs run eager pipeline stages


@pytest.mark.parametrize(("name", "bundles"), [
    ("vllm-gpu-tp.yaml", [{"CPU": 2}, {"GPU": 1}, {"GPU": 1}]),
    ("vllm-local-tp.yaml", [{"CPU": 0.5}, {"CPU": 1}, {"CPU": 1}, {"CPU": 1}]),  # 3 CPU ranks (9 heads)
])
def test_tp_yaml_builds_an_app_with_the_placement_group(name, bundles):
    """The multi-rank configs through the real app builder (no Ray cluster needed to build)."""
    import yaml

    from serve_app.serving.app import build_app

    spec = yaml.safe_load((REPO / "configs" / name).read_text())["applications"][0]
    app = build_app(spec["args"])
    server = app._bound_deployment.init_args[0]  # the ingress is bound to the LLMServer application
    deployment = server._bound_deployment
    assert deployment._replica_config.placement_group_bundles == bundles
    assert deployment._replica_config.placement_group_strategy == "STRICT_PACK"
    assert "num_gpus" not in deployment._replica_config.ray_actor_options


def test_speculative_option_maps_to_vllm_speculative_config():
    """The native engine's `speculative` option means the same on vLLM (fixed k: vLLM has no adaptive length)."""
    args = vllm_config(speculative={"method": "ngram", "max_k": 3}).backend_config.options.async_engine_args("/m", "m")
    assert args["speculative_config"] == {"method": "ngram", "num_speculative_tokens": 3,
                                          "prompt_lookup_min": 2, "prompt_lookup_max": 4}
    fixed = vllm_config(speculative={"method": "ngram", "k": 2, "ngram_min": 3}).backend_config.options.async_engine_args("/m", "m")
    assert fixed["speculative_config"]["num_speculative_tokens"] == 2 and fixed["speculative_config"]["prompt_lookup_min"] == 3
    assert "speculative_config" not in vllm_config(speculative={"method": "off"}).backend_config.options.async_engine_args("/m", "m")
    draft = vllm_config(speculative={"method": "draft", "draft_model": "models/d", "k": 3, "acceptance": "rejection"})
    assert draft.backend_config.options.async_engine_args("/m", "m")["speculative_config"] == {
        "method": "draft_model", "model": "models/d", "num_speculative_tokens": 3}
    with pytest.raises(ValueError, match="^speculative.acceptance:.*rejection sampling only"):  # vLLM has no exact rule
        vllm_config(speculative={"method": "draft", "draft_model": "models/d"})  # rejected where the config is loaded
    with pytest.raises(ValueError, match="^speculative.method:"):
        vllm_config(speculative={"method": "eagle"})
    with pytest.raises(ValueError, match="^engine_args:"):
        vllm_config(engine_args={"speculative_config": {"method": "ngram"}})
