"""Builds the Ray Serve application (OpenAIIngress → LLMServer) from a `ServeConfig`.

A Serve YAML points at `serve_app.serving.app:build_app` and passes the `ServeConfig` fields as
`args` (see configs/local.yaml). Runs on the driver: it never imports torch (the engine is imported
inside each LLMServer replica). Relative model paths are resolved here, against the current directory
and then the repository root, so replicas (whatever their working directory) get an absolute path.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from ray.serve import Application, Deployment
from ray.serve.config import RequestRouterConfig

from serve_app.serving.config import ServeConfig
from serve_app.serving.ingress import OpenAIIngress
from serve_app.serving.llm_server import ABORT_GRACE_S, LLMServer
from serve_app.serving.placement import replica_placement

logger = logging.getLogger(__name__)

REPO_ROOT = Path(__file__).resolve().parents[2]


def resolve_model_path(model: str) -> str:
    """An absolute path for a local model directory given relative to the cwd or the repo root."""
    path = Path(model).expanduser()
    if path.is_absolute():
        return str(path)
    for base in (Path.cwd(), REPO_ROOT):
        if (base / path).is_dir():
            return str((base / path).resolve())
    raise ValueError(f"model: {model!r} is not a directory here or under {REPO_ROOT} (run `make model` for the default model)")


def request_router_config(config: ServeConfig) -> RequestRouterConfig:
    """The LLMServer router of `config.routing` (built and validated with the config)."""
    routing = config.routing
    return RequestRouterConfig(request_router_class=routing.router_class, request_router_kwargs=routing.request_router_kwargs,
                               request_routing_stats_period_s=routing.stats_period_s)


def llm_server_app(config: ServeConfig, deployment: Deployment = LLMServer) -> Application:
    """The LLMServer deployment (or `deployment`, a class made like it) with the options of `config`, bound."""
    placement = replica_placement(config)
    autoscaling = config.autoscaling_settings
    # autoscaling: Serve scales between min and max replicas on load; otherwise a fixed count
    scaling = {"autoscaling_config": autoscaling.to_serve()} if autoscaling else {"num_replicas": config.num_replicas}
    return deployment.options(
        **scaling,
        **placement,
        max_ongoing_requests=config.max_ongoing_requests,
        max_queued_requests=config.max_queued_requests,
        request_router_config=request_router_config(config),
        health_check_period_s=config.health_check_period_s,
        health_check_timeout_s=config.health_check_timeout_s,
        # Serve kills a stopping replica at this deadline: the replica's own drain ends before it
        graceful_shutdown_timeout_s=config.drain_timeout_s + ABORT_GRACE_S,
        **({"max_replicas_per_node": config.max_replicas_per_node} if config.max_replicas_per_node else {}),
    ).bind(config)


def build_app_from_config(config: ServeConfig) -> Application:
    autoscaling = config.autoscaling_settings
    server = llm_server_app(config)
    ingress = OpenAIIngress.options(
        num_replicas=config.ingress_num_replicas,
        ray_actor_options={"num_cpus": config.ingress_num_cpus},
        max_ongoing_requests=config.ingress_max_ongoing_requests,
        max_queued_requests=config.ingress_max_queued_requests,
    ).bind(server, config)  # no key here: init args live in Serve's controller state
    replicas = (f"{autoscaling.min_replicas}-{autoscaling.max_replicas} (autoscaling)" if autoscaling
                else str(config.num_replicas))
    sources = [s for s in (f"${config.api_key_env}" if config.api_key_env else "", config.api_keys_file) if s]
    logger.info("serving %s (%s LLMServer replica(s), router %s, API keys from %s)", config.model_name, replicas,
                config.request_router_class or config.router,
                " and ".join(sources) + " in each ingress replica" if sources else "nowhere (no authentication)")
    return ingress


def load_serve_config(args: dict[str, Any]) -> ServeConfig:
    """A Serve YAML's `args`, validated once into the `ServeConfig` every deployment receives (the
    model path made absolute first)."""
    if "model" not in args:
        raise ValueError("model: a model directory is required")
    return ServeConfig.from_dict({**args, "model": resolve_model_path(str(args["model"]))})


def build_app(args: dict[str, Any]) -> Application:
    """Serve application builder (`import_path: serve_app.serving.app:build_app`)."""
    return build_app_from_config(load_serve_config(args))
