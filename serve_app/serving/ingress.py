"""OpenAIIngress: the Ray Serve deployment that answers HTTP (FastAPI) and calls LLMServer.

The FastAPI app is built per replica (`__serve_build_asgi_app__`) from the `ServeConfig`, so nothing
lives in module globals. The constructor waits until an LLMServer replica answers `model_info()`,
so a RUNNING ingress means the API can serve; it then logs the URL clients use.
"""

from __future__ import annotations

import logging

from fastapi import FastAPI
from ray import serve
from ray.serve.handle import DeploymentHandle

from serve_app.config import ServeConfig
from serve_app.serving.api import OpenAIAPI, build_fastapi_app

logger = logging.getLogger("ray.serve")


@serve.deployment(name="OpenAIIngress")
@serve.ingress()
class OpenAIIngress:
    async def __init__(self, llm: DeploymentHandle, config: ServeConfig, api_key: str = "") -> None:
        self._api_key = api_key
        info = await llm.model_info.remote()
        self.api = OpenAIAPI(llm, config, info)
        logger.info("OpenAI-compatible API ready: model %r (context %d tokens, backend %s)",
                    info.name, info.max_model_len, info.backend)

    def __serve_build_asgi_app__(self) -> FastAPI:
        return build_fastapi_app(self.api, self._api_key)
