"""Fail closed through a real Ray Serve deployment: with Serve's HTTP host set to a non-loopback address
and no API key, the ingress refuses to start and the deployment fails with the reason; with
`allow_unauthenticated: true` (or a key) it starts.

Nothing binds a network address here: Serve's proxies are disabled (`proxy_location: Disabled`), so
`http_options.host: 0.0.0.0` is only the configured host the ingress reads from Serve's controller,
exactly as it does behind real proxies. The LLMServer replicas run the null backend (no model
weights), which keeps each deployment to seconds."""

from __future__ import annotations

import contextlib

import pytest

from tests.serving.conftest import API_KEY_ENV, APP_NAME, free_port

pytestmark = pytest.mark.startup(reason="deploys Serve applications on a shared machine; a replica start can be slow")

EXPOSED_HOST = "0.0.0.0"


def args(**overrides):
    from tests.serving.conftest import MODEL_DIR

    base = {"model": str(MODEL_DIR), "backend": "null", "num_replicas": 1,
            "num_cpus_per_replica": 0.1, "ingress_num_cpus": 0.05, "api_key_env": "", "tokenize_in_ingress": False,
            "engine": {"step_time_s": 0.01}}
    base.update(overrides)
    return base


@contextlib.contextmanager
def serve_without_proxies(host: str):
    from ray import serve

    serve.start(proxy_location="Disabled", http_options={"host": host, "port": free_port()})
    try:
        yield serve
    finally:
        with contextlib.suppress(Exception):
            serve.delete(APP_NAME)
        serve.shutdown()


def test_no_key_on_a_non_loopback_host_refuses_to_start(ray_cluster):
    from serve_app.serving.app import build_app

    with serve_without_proxies(EXPOSED_HOST) as serve:
        with pytest.raises(RuntimeError, match="OpenAIIngress"):  # DEPLOY_FAILED
            serve.run(build_app(args()), name=APP_NAME, route_prefix="/llm")
        ingress = serve.status().applications[APP_NAME].deployments["OpenAIIngress"]
        assert ingress.status == "DEPLOY_FAILED"
        assert "refusing to start" in ingress.message and "allow_unauthenticated" in ingress.message, ingress.message


@pytest.mark.parametrize("overrides", [{"allow_unauthenticated": True}, {"api_key_env": API_KEY_ENV}],
                         ids=["explicitly-allowed", "with-a-key"])
def test_an_explicit_opt_out_or_a_key_starts(ray_cluster, overrides):
    from serve_app.serving.app import build_app

    with serve_without_proxies(EXPOSED_HOST) as serve:
        handle = serve.run(build_app(args(**overrides)), name=APP_NAME, route_prefix="/llm")
        assert handle is not None
        assert serve.status().applications[APP_NAME].status == "RUNNING"
