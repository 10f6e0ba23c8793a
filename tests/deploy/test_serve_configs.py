"""Every Serve config we ship (configs/*.yaml and the RayService's serveConfigV2) is one `serve deploy`
accepts: it validates against Ray's own schema (`ServeDeploySchema`), its import path resolves to the
app builder, the builder builds it (model path substituted with the local model where the config's
path exists only in the image), and the request routers it names are importable Serve routers.
Nothing here starts Ray: building an application only binds deployments.
"""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Any

import pytest
import yaml
from ray.serve.request_router import RequestRouter
from ray.serve.schema import ServeDeploySchema

from serve_app.serving.config import ServeConfig
from serve_app.serving.routing_config import ROUTER_CLASSES
from tests.deploy.manifests import CONFIG_DIR, DOCKERFILE, rayservice, serve_configs

CONFIGS = serve_configs()
LOCAL_MODELS = Path(__file__).resolve().parents[2] / "models"


def import_attr(path: str) -> Any:
    module, _, attr = path.replace(":", ".").rpartition(".")
    return getattr(importlib.import_module(module), attr)


def local_args(args: dict[str, Any]) -> dict[str, Any]:
    """The app args with the model path made local: a path that exists only in the image
    (/app/models/<name>) becomes models/<name> here (same model, same directory name)."""
    model = Path(args["model"])
    if model.is_absolute() and not model.is_dir():
        assert (LOCAL_MODELS / model.name).is_dir(), f"no local copy of {model.name} under models/"
        return {**args, "model": str(LOCAL_MODELS / model.name)}
    return dict(args)


def built_deployments(app_config: dict[str, Any]) -> dict[str, Any]:
    """Call the config's builder the way Serve does and return the bound deployments by name."""
    from ray.serve._private.build_app import build_app

    builder = import_attr(app_config["import_path"])
    app = builder(local_args(app_config["args"]))
    return {d.name: d for d in build_app(app, name=app_config["name"]).deployments}


def test_every_config_file_is_covered():
    assert {p.name for p in CONFIG_DIR.glob("*.yaml")} | {"rayservice.yaml:serveConfigV2"} == set(CONFIGS)
    assert {"local.yaml", "gpu.yaml"} <= set(CONFIGS)


@pytest.mark.parametrize("label", sorted(CONFIGS))
def test_config_validates_and_builds(label):
    raw = CONFIGS[label]
    schema = ServeDeploySchema.model_validate(raw)  # Ray's own schema (what `serve deploy` checks)
    assert schema.applications, label
    for application in raw["applications"]:
        assert callable(import_attr(application["import_path"])), application["import_path"]
        config = ServeConfig.from_dict(local_args(application["args"]))  # our args schema
        deployments = built_deployments(application)
        assert {"OpenAIIngress", "LLMServer"} <= set(deployments), label
        server = deployments["LLMServer"]
        router_config = server._deployment_config.request_router_config
        router = import_attr(router_config.request_router_class)
        assert isinstance(router, type) and issubclass(router, RequestRouter), router_config.request_router_class
        expected = config.request_router_class or ROUTER_CLASSES[config.router]
        assert router_config.request_router_class.replace(":", ".") == expected.replace(":", ".")
        assert server.ray_actor_options.get("num_gpus", 0) == config.num_gpus_per_replica
        scaling = config.autoscaling_settings
        serve_scaling = server._deployment_config.autoscaling_config
        if scaling is None:
            assert serve_scaling is None and server._deployment_config.num_replicas == config.num_replicas
        else:  # Serve's AutoscalingConfig got exactly our settings
            assert serve_scaling is not None
            for name, value in scaling.to_serve().items():
                actual = getattr(serve_scaling, name)
                assert (actual.value if hasattr(actual, "value") else actual) == value, (label, name)


@pytest.mark.parametrize("name", sorted(ROUTER_CLASSES))
def test_router_class_paths_resolve(name):
    router = import_attr(ROUTER_CLASSES[name])
    assert issubclass(router, RequestRouter)


@pytest.mark.parametrize("label", [k for k in sorted(CONFIGS) if k != "local.yaml"])
def test_gpu_configs_autoscale_one_gpu_per_replica(label):
    for application in CONFIGS[label]["applications"]:
        config = ServeConfig.from_dict(local_args(application["args"]))
        if config.backend_config.device != "cuda":
            continue
        scaling = config.autoscaling_settings
        ranks = config.backend_config.world_size
        # one GPU per replica, or (tensor / pipeline parallel) one per rank in the replica's placement group
        assert config.num_gpus_per_replica == (1 if ranks == 1 else 0), label
        assert scaling is not None and scaling.max_replicas > scaling.min_replicas >= 1, label
        assert scaling.target_ongoing_requests < config.max_ongoing_requests, "scale before replicas reject"


def test_rayservice_serves_the_gpu_config_with_the_image_model_path():
    """serveConfigV2 is configs/gpu.yaml (drift check), with the model where the image has it and the
    API keys from the mounted Secret (one file per tenant) instead of an environment variable."""
    embedded = CONFIGS["rayservice.yaml:serveConfigV2"]
    gpu = CONFIGS["gpu.yaml"]
    assert {k: v for k, v in embedded.items() if k != "applications"} == \
        {k: v for k, v in gpu.items() if k != "applications"}
    (ours,), (theirs,) = embedded["applications"], gpu["applications"]
    key_source = {"model": None, "api_key_env": None, "api_keys_file": None}
    assert {**ours["args"], **key_source} == {**theirs["args"], **key_source}
    assert ours["args"]["api_key_env"] == "" and ours["args"]["api_keys_file"] == "/etc/serve-app/api-keys"
    assert {k: v for k, v in ours.items() if k != "args"} == {k: v for k, v in theirs.items() if k != "args"}
    workdir = [line.split()[1] for line in DOCKERFILE.read_text().splitlines() if line.startswith("WORKDIR")][-1]
    assert ours["args"]["model"] == f"{workdir}/{theirs['args']['model']}", "the image's model directory"
    assert yaml.safe_load(rayservice()["spec"]["serveConfigV2"])["proxy_location"] == "EveryNode"
