"""Ray's `PrefixCacheAffinityRouter`, adapted to our requests, for W4. Ray's router reads the `messages` or
`prompt` attribute of the first argument that has one; our `GenerateRequest` has both (the unused one None),
so the adapter hands it the one that is set (chat messages as a list; calls that are no generation get no
text and are routed as power of two). Everything else is Ray's. It is imported from its defining module (the
public `ray.serve.llm.request_router` first imports Ray Serve LLM's OpenAI models, which need vLLM or
SGLang); that needs `pyarrow`, a benchmark-only dependency `make bench-prefix` installs.
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
