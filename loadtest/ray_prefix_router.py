"""Ray's `PrefixCacheAffinityRouter` (ray.serve.llm.request_router), adapted to our requests, for W4.

The only adaptation: Ray's router reads the text of a request's `prompt` or `messages` and handles
messages only as a list, while our `GenerateRequest.messages` is a tuple (it then sees an empty
prompt, and routes every chat as if it shared nothing). This subclass hands it the messages as a list;
everything else (its character prefix tree built from its own routing history, its defaults) is
Ray's. It is imported from the module that defines it: the public path, `ray.serve.llm.request_router`,
re-exports the same class but first imports Ray Serve LLM's OpenAI models, which need vLLM or SGLang
installed. Importing it needs `pyarrow` (Ray's `llm` extra): a benchmark-only dependency, installed
by `make bench-prefix`, never by the default install.
"""

from __future__ import annotations

from typing import Any

from ray.llm._internal.serve.routing_policies.prefix_aware.prefix_aware_router import (
    PrefixCacheAffinityRouter,
)


class RayPrefixCacheAffinityRouter(PrefixCacheAffinityRouter):
    def _normalize_prompt_to_string(self, prompt: Any) -> str:
        return super()._normalize_prompt_to_string(list(prompt) if isinstance(prompt, tuple) else prompt)
