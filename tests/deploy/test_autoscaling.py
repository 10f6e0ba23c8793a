"""LLMServer autoscaling: `ServeConfig.autoscaling` is validated once (bad values name the field) and
reaches Serve as the deployment's `autoscaling_config`, in place of a fixed `num_replicas`."""

from __future__ import annotations

import pickle

import pytest
from ray.serve.config import AutoscalingConfig

from serve_app.serving.autoscaling import AutoscalingSettings
from serve_app.serving.config import ServeConfig

SCALING = {"min_replicas": 1, "max_replicas": 4, "target_ongoing_requests": 32}


def serve_config(**overrides) -> ServeConfig:
    return ServeConfig.from_dict({"model": "models/x", "max_ongoing_requests": 64, **overrides})


def test_settings_are_frozen_picklable_and_serve_compatible():
    cfg = serve_config(autoscaling={**SCALING, "upscale_delay_s": 10})
    assert cfg.autoscaling == (("max_replicas", 4), ("min_replicas", 1), ("target_ongoing_requests", 32),
                               ("upscale_delay_s", 10))
    assert pickle.loads(pickle.dumps(cfg)) == cfg
    settings = cfg.autoscaling_settings
    assert settings == AutoscalingSettings(max_replicas=4, target_ongoing_requests=32, upscale_delay_s=10)
    serve = AutoscalingConfig(**settings.to_serve())  # Serve accepts exactly what we pass
    assert (serve.min_replicas, serve.max_replicas, serve.target_ongoing_requests) == (1, 4, 32)
    assert serve.upscale_delay_s == 10 and serve.downscale_delay_s == 600  # unset: Serve's default
    assert "initial_replicas" not in settings.to_serve()


@pytest.mark.parametrize("value", [None, {}])
def test_unset_means_a_fixed_replica_count(value):
    cfg = serve_config(num_replicas=3, autoscaling=value)
    assert cfg.autoscaling == () and cfg.autoscaling_settings is None


@pytest.mark.parametrize(("autoscaling", "overrides", "field"), [
    ({"max_replicas": 4}, {}, "autoscaling.target_ongoing_requests"),
    ({"target_ongoing_requests": 8}, {}, "autoscaling.max_replicas"),
    ({**SCALING, "max_replica": 4}, {}, "autoscaling.max_replica"),
    ({**SCALING, "min_replicas": 5}, {}, "autoscaling.max_replicas"),
    ({**SCALING, "min_replicas": -1}, {}, "autoscaling.min_replicas"),
    ({**SCALING, "max_replicas": 0, "min_replicas": 0}, {}, "autoscaling.max_replicas"),
    ({**SCALING, "max_replicas": 2.5}, {}, "autoscaling.max_replicas"),
    ({**SCALING, "initial_replicas": 9}, {}, "autoscaling.initial_replicas"),
    ({**SCALING, "target_ongoing_requests": 0}, {}, "autoscaling.target_ongoing_requests"),
    ({**SCALING, "target_ongoing_requests": True}, {}, "autoscaling.target_ongoing_requests"),
    ({**SCALING, "upscale_delay_s": -1}, {}, "autoscaling.upscale_delay_s"),
    ({**SCALING, "look_back_period_s": 0}, {}, "autoscaling.look_back_period_s"),
    ({**SCALING, "downscale_to_zero_delay_s": 5}, {}, "autoscaling.downscale_to_zero_delay_s"),
    ({**SCALING, "upscaling_factor": 0}, {}, "autoscaling.upscaling_factor"),
    ({**SCALING, "aggregation_function": "median"}, {}, "autoscaling.aggregation_function"),
    (SCALING, {"num_replicas": 2}, "num_replicas"),
    ({**SCALING, "target_ongoing_requests": 100}, {}, "autoscaling"),  # above max_ongoing_requests (64)
])
def test_bad_settings_raise_naming_the_field(autoscaling, overrides, field):
    with pytest.raises(ValueError, match=rf"^{field}:"):
        serve_config(autoscaling=autoscaling, **overrides)


def test_scale_to_zero_is_allowed():
    cfg = serve_config(autoscaling={**SCALING, "min_replicas": 0, "downscale_to_zero_delay_s": 900})
    assert AutoscalingConfig(**cfg.autoscaling_settings.to_serve()).min_replicas == 0


def test_app_passes_autoscaling_instead_of_num_replicas(model_dir):
    from ray.serve._private.build_app import build_app as build_serve_app

    from serve_app.serving.app import build_app

    def llm_server(args):
        (server,) = [d for d in build_serve_app(build_app(args), name="llm").deployments if d.name == "LLMServer"]
        return server._deployment_config

    fixed = llm_server({"model": model_dir, "num_replicas": 3, "api_key_env": ""})
    assert fixed.num_replicas == 3 and fixed.autoscaling_config is None
    scaled = llm_server({"model": model_dir, "api_key_env": "", "autoscaling": {**SCALING, "downscale_delay_s": 120}})
    assert scaled.autoscaling_config.min_replicas == 1 and scaled.autoscaling_config.max_replicas == 4
    assert scaled.autoscaling_config.target_ongoing_requests == 32
    assert scaled.autoscaling_config.downscale_delay_s == 120
