"""OpenAIIngress: the Ray Serve deployment that answers HTTP (FastAPI) and calls LLMServer.

The FastAPI app is built per replica (`__serve_build_asgi_app__`) from the `ServeConfig`, so nothing
lives in module globals. The constructor waits until an LLMServer replica answers `model_info()`,
so a RUNNING ingress means the API can serve; it then logs the URL clients use. With
`tokenize_in_ingress` it loads the model's tokenizer (the class the engine loaded, `ModelInfo`)
through the same `InputProcessor` the engines run (serve_app/input_processor.py, torch-free: this
process never imports torch), and prompts are tokenized here, once (the router hashes those ids;
replicas do not tokenize again).
With `stream_multiplexing` it opens this replica's stream channel (`serving.stream_mux`).

The API keys are read here, in the replica's own process, from the environment variable the config
names (`api_key_env`) and the keys file (`api_keys_file`): they never travel as deployment
arguments, which Serve would keep in its controller state and show on its dashboard. Before anything
else the replica fails closed: no key while Serve's HTTP host is not loopback raises (the replica,
and so the deployment, never starts) unless the config allows it (`serving.exposure`).
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

import ray
import ray.util
from fastapi import FastAPI
from ray import serve
from ray.serve.handle import DeploymentHandle

from serve_app.backends.base import ModelInfo
from serve_app.metrics.api_metrics import APIMetrics
from serve_app.serving.api import OpenAIAPI, build_fastapi_app
from serve_app.serving.api_keys import Keyring
from serve_app.serving.config import ServeConfig
from serve_app.serving.exposure import check_exposure, serve_http_host
from serve_app.serving.stream_mux import MuxReceiver

logger = logging.getLogger("ray.serve")


def make_input_processor(config: ServeConfig, info: ModelInfo):
    """The engines' `InputProcessor` for the served model, with the tokenizer class the engine
    loaded, or None (`tokenize_in_ingress` off, or no tokenizer files: the replicas then tokenize)."""
    if not config.tokenize_in_ingress or not (Path(config.model) / "tokenizer.json").is_file():
        return None
    from serve_app.input_processor import InputProcessor  # transformers (not torch): in the replica only

    vocab_size = int(json.loads((Path(config.model) / "config.json").read_text())["vocab_size"])
    return InputProcessor(config.model, vocab_size, info.max_model_len, info.tokenizer_class)


def api_key_from_env(variable: str) -> str:
    """The API key in environment variable `variable` ("" when unset, or when `variable` is "")."""
    key = os.environ.get(variable, "").strip() if variable else ""
    if variable and not key:
        logger.warning("no API key in $%s in this ingress replica", variable)
    return key


async def load_keyring(config: ServeConfig, exposed_host: str | None = None) -> Keyring:
    """The replica's API keys; raises (the replica does not start) when the keys file is unusable,
    or when there is no key and the address the API answers on (`exposed_host`, else Serve's HTTP
    host) is not loopback and the config does not allow it."""
    keyring = Keyring(api_key_from_env(config.api_key_env), config.api_keys_file, config.api_keys_reload_s)
    check_exposure(exposed_host or await serve_http_host(), keyring.enabled, config.allow_unauthenticated)
    if keyring.enabled:
        logger.info("API keys: %d tenant(s)%s", keyring.num_tenants,
                    f", from {config.api_keys_file} (reloaded when it changes)" if config.api_keys_file else "")
    return keyring


@serve.deployment(name="OpenAIIngress")
@serve.ingress()
class OpenAIIngress:
    async def __init__(self, llm: DeploymentHandle, config: ServeConfig) -> None:
        keyring = await load_keyring(config)
        info = await llm.model_info.remote()
        mux = None
        if config.stream_multiplexing:
            mux = await MuxReceiver().start(ray.get_runtime_context().get_node_id(), ray.util.get_node_ip_address())
        self.api = OpenAIAPI(llm, config, info, make_input_processor(config, info), mux, keyring)
        self._metrics = APIMetrics.for_ray(info.name)
        logger.info("OpenAI-compatible API ready: model %r (context %d tokens, backend %s)",
                    info.name, info.max_model_len, info.backend)

    def __serve_build_asgi_app__(self) -> FastAPI:
        return build_fastapi_app(self.api, record=self._metrics.record)
