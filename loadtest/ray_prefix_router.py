"""Ray's `PrefixCacheAffinityRouter` for W4 (docs/prefix_routing.md#benchmark-w4), handed whichever of `prompt` /
`messages` (as a list) our `GenerateRequest` carries; calls that are no generation get no text (power of two).
Imported from its defining module (the public one imports Ray Serve LLM's OpenAI models, which need vLLM or
SGLang); that needs `pyarrow`, which `make bench-prefix` installs.
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
