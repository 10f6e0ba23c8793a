"""Ray's `PrefixCacheAffinityRouter` (ray.serve.llm.request_router), adapted to our requests, for W4.

Ray's router looks for the first handle-call argument with a `messages` or a `prompt` attribute and
reads that attribute. Its own requests have one or the other; our `GenerateRequest` has both (the
unused one is None), so it would read `messages = None` of a completion and refuse the request. The
adapter hands it the one that is set (chat messages as a list: Ray's router joins list contents
only). Calls that are not a generation (`model_info`) get no text, which Ray's router routes as
power of two. Everything else (its character prefix tree built from its own routing history, its
defaults) is Ray's. It is imported from the module that defines it: the public path,
`ray.serve.llm.request_router`, re-exports the same class but first imports Ray Serve LLM's OpenAI
models, which need vLLM or SGLang installed. Importing it needs `pyarrow` (Ray's `llm` extra): a
benchmark-only dependency, installed by `make bench-prefix`, never by the default install.
"""

from __future__ import annotations

from ray.llm._internal.serve.routing_policies.prefix_aware.prefix_aware_router import (
    PrefixCacheAffinityRouter,
)
from ray.serve.request_router import PendingRequest

from serve_app.serving.request_size import find_request


class RayPrefixCacheAffinityRouter(PrefixCacheAffinityRouter):
    def _extract_text_from_request(self, pending_request: PendingRequest) -> str | None:
        request = find_request(pending_request.args, pending_request.kwargs)
        if request is None:
            return None
        prompt = list(request.messages) if request.messages is not None else request.prompt
        return self._normalize_prompt_to_string(prompt)
