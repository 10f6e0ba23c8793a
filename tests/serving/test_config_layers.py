"""One typed config per layer (engine, backend, serving, routing), validated once where a Serve YAML's
`args` are loaded and handed down as objects: the deployments, the replica's backend and the engine
receive what was built then, never a mapping to parse again (docs/architecture.md, Configuration
layers). No Ray cluster, no model weights."""

from __future__ import annotations

import base64
import json
import pickle
import subprocess
import sys

import pytest

from serve_app.backends import BackendConfig, make_backend
from serve_app.backends.native import NativeBackend
from serve_app.backends.vllm_options import VLLMOptions
from serve_app.engine.config import EngineConfig, ModelConfig
from serve_app.serving import app as app_module
from serve_app.serving.autoscaling import AutoscalingSettings
from serve_app.serving.config import ServeConfig
from serve_app.serving.placement import replica_placement
from serve_app.serving.routing_config import KVRouterSettings, RoutingConfig
from tests.serving.conftest import REPO


def count_validations(monkeypatch, cls: type) -> list[int]:
    """Counts `cls` constructions (its `__post_init__` runs each time, then the real one)."""
    calls = [0]
    real = cls.__post_init__

    def counted(self) -> None:
        calls[0] += 1
        real(self)

    monkeypatch.setattr(cls, "__post_init__", counted)
    return calls


def test_each_layer_is_validated_once_and_handed_down_as_an_object(monkeypatch, tmp_path):
    model = tmp_path / "tiny"
    model.mkdir()
    engines = count_validations(monkeypatch, ModelConfig)
    routers = count_validations(monkeypatch, KVRouterSettings)
    scalers = count_validations(monkeypatch, AutoscalingSettings)
    args = {"model": str(model), "num_replicas": 1, "engine": {"max_num_seqs": 4, "dtype": "bfloat16"},
            "router_kwargs": {"prefill_weight": 0.5}, "autoscaling": {"max_replicas": 3, "target_ongoing_requests": 2}}
    config = app_module.load_serve_config(args)
    assert (engines[0], routers[0], scalers[0]) == (1, 1, 1)

    # what the driver then does with it: deployment options, the router's arguments, the app itself
    app_module.request_router_config(config)
    replica_placement(config)
    app_module.build_app_from_config(config)
    # what each replica gets: the pickled config, from which it builds its backend and engine
    replica_config = pickle.loads(pickle.dumps(config))
    backend = make_backend(replica_config.backend_config)
    assert (engines[0], routers[0], scalers[0]) == (1, 1, 1)

    assert isinstance(backend, NativeBackend) and backend.engine_config == config.backend_config.options
    engine_config = backend.engine_config
    assert isinstance(engine_config, EngineConfig)  # the engine receives an object, not a dict
    assert (engine_config.scheduler.max_num_seqs, engine_config.model.dtype) == (4, "bfloat16")
    assert config.routing.settings.prefill_weight == 0.5 and config.autoscaling_settings.max_replicas == 3
    assert config.engine == (("dtype", "bfloat16"), ("max_num_seqs", 4))  # the YAML's values, as given


@pytest.mark.parametrize(("args", "message"), [
    ({"engine": {"max_num_seqs": 0}}, "max_num_seqs: must be >= 1"),
    ({"engine": {"speculative": {"method": "ngram", "k": 9}}}, "speculative.k: must be in [0, max_k]"),
    ({"engine": {"batch_size": 3}, "backend": "vllm"}, "batch_size: not a vLLM backend option"),
    ({"backend": "vllm", "engine": {"block_size": 8}}, "block_size: must be 0 (vLLM's default) or a multiple of 16"),
    ({"router_kwargs": {"prefill_weight": -1}}, "prefill_weight: must be a finite number >= 0"),
    ({"router": "round_robin", "router_kwargs": {"prefill_weight": 1}}, "router_kwargs: only the prefix_aware"),
    ({"router": "fastest"}, "router: must be one of"),
    ({"autoscaling": {"max_replicas": 0, "target_ongoing_requests": 2}}, "autoscaling.max_replicas: must be >= 1"),
    ({"backend": "nowhere:Backend"}, "backend: cannot import 'nowhere:Backend'"),
    ({"ingress_num_replicas": 0}, "ingress_num_replicas: must be an integer >= 1"),
    ({"omp_wait_policy": "PASSIVE"}, "omp_wait_policy: must be one of ('passive', 'active', 'default')"),
    ({"omp_spin_count": -2}, "omp_spin_count: must be an integer >= 0, or -1 for OpenMP's own"),
])
def test_a_bad_field_is_rejected_at_load_naming_its_path(tmp_path, args, message):
    """Every layer's mistake surfaces when the YAML's `args` are loaded (before any deployment is
    built), named as the user wrote it."""
    (tmp_path / "tiny").mkdir()
    with pytest.raises(ValueError) as caught:
        app_module.build_app({"model": str(tmp_path / "tiny"), **args})
    assert str(caught.value).startswith(message), caught.value


def test_layer_configs_are_typed_and_complete():
    native = ServeConfig(model="models/x", served_model_name="chat", engine={"kv_cache_memory_gib": 0.5})
    assert native.backend_config == BackendConfig("native", "models/x", "chat", native.backend_config.options)
    assert native.backend_config.options.cache.kv_cache_gib == 0.5
    vllm = ServeConfig(model="models/x", backend="vllm", router="kv_aware", engine={"tensor_parallel_size": 2})
    assert isinstance(vllm.backend_config.options, VLLMOptions) and vllm.backend_config.world_size == 2
    # the router's settings are completed from what the deployment knows, validated, and sent whole
    assert vllm.routing == RoutingConfig("serve_app.serving.router:KVCacheAwareRouter", 0.5, KVRouterSettings(
        model_name="x", block_size=128, stats_period_s=0.5, confirmed_ttl_s=660.0))
    assert KVRouterSettings.from_kwargs(json.loads(json.dumps(vllm.routing.request_router_kwargs))) == vllm.routing.settings
    assert ServeConfig(model="models/x", router="pow2").routing.request_router_kwargs == {}
    assert native.autoscaling_settings is None
    with pytest.raises(ValueError, match="^routing: not a serving option"):
        ServeConfig.from_dict({"model": "models/x", "routing": {}})  # derived attributes are not YAML keys


# builds every layer's config without torch (the driver), then unpickles it in a fresh process (what
# an ingress replica does with its init arguments): neither loads torch
BUILD = """
import base64, pickle, sys
from serve_app.serving.config import ServeConfig
configs = [ServeConfig(model="models/x", engine={"speculative": {"method": "ngram"}}),
           ServeConfig(model="models/x", backend="vllm", autoscaling={"max_replicas": 2, "target_ongoing_requests": 4})]
assert "torch" not in sys.modules
print(base64.b64encode(pickle.dumps(configs)).decode())
"""
LOAD = """
import base64, json, pickle, sys
import serve_app.engine
configs = pickle.loads(base64.b64decode(sys.stdin.read()))
print(json.dumps({"torch": "torch" in sys.modules, "options": [type(c.backend_config.options).__name__ for c in configs],
                  "routers": [type(c.routing.settings).__name__ for c in configs]}))
"""


def test_every_layer_config_loads_and_unpickles_without_torch():
    built = subprocess.run([sys.executable, "-c", BUILD], capture_output=True, text=True, timeout=120, cwd=REPO)
    assert built.returncode == 0, built.stderr[-2000:]
    pickled = built.stdout.strip().splitlines()[-1]
    assert pickle.loads(base64.b64decode(pickled))[0].backend_config.options.speculative.enabled
    loaded = subprocess.run([sys.executable, "-c", LOAD], input=pickled, capture_output=True, text=True, timeout=120, cwd=REPO)
    assert loaded.returncode == 0, loaded.stderr[-2000:]
    assert json.loads(loaded.stdout.strip().splitlines()[-1]) == {
        "torch": False, "options": ["EngineConfig", "VLLMOptions"], "routers": ["KVRouterSettings", "KVRouterSettings"]}


@pytest.mark.parametrize(("policy", "spins", "device", "env"), [
    ("passive", -1, "cpu", {"OMP_WAIT_POLICY": "PASSIVE"}), ("active", -1, "cpu", {"OMP_WAIT_POLICY": "ACTIVE"}),
    ("default", -1, "cpu", None), ("passive", -1, "cuda", None),
    ("passive", 3000, "cpu", {"OMP_WAIT_POLICY": "PASSIVE", "GOMP_SPINCOUNT": "3000"}),
    ("default", 0, "cpu", {"GOMP_SPINCOUNT": "0"}), ("passive", 3000, "cuda", None),
])
def test_a_cpu_replica_starts_with_the_openmp_wait_policy(policy, spins, device, env):
    """OpenMP reads OMP_WAIT_POLICY and GOMP_SPINCOUNT once, when it loads: the replica's actor must
    start with them in its environment (a runtime_env), not set them later; `default`, -1 and GPU
    replicas leave them alone."""
    config = ServeConfig(model="models/x", omp_wait_policy=policy, omp_spin_count=spins, engine={"device": device})
    options = replica_placement(config)["ray_actor_options"]
    assert options.get("runtime_env", {}).get("env_vars") == env


def test_a_replica_below_normal_priority_warns_with_the_fix():
    """Ray's workers start at niceness 15 unless the cluster is started with RAY_worker_niceness=0;
    a replica at a positive niceness says so and how to fix it, one at 0 (or below) says nothing."""
    from serve_app.serving.config import WORKER_NICENESS_ENV
    from serve_app.serving.llm_server import niceness_warning

    assert niceness_warning(0) is None and niceness_warning(-5) is None
    warning = niceness_warning(15)
    assert warning is not None and "niceness 15" in warning and f"{WORKER_NICENESS_ENV}=0" in warning
