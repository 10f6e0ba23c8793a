"""The W4 benchmark's adapter for Ray's `PrefixCacheAffinityRouter` (loadtest/ray_prefix_router.py)
reads the text our requests carry: a completion's prompt, a chat's messages, nothing for calls that
are not generations. Needs pyarrow (the benchmark-only `bench-prefix` extra): skipped without it."""

from __future__ import annotations

import asyncio

import pytest

pytest.importorskip("pyarrow")

from loadtest.ray_prefix_router import RayPrefixCacheAffinityRouter  # noqa: E402
from serve_app.types import GenerateRequest, SamplingParams  # noqa: E402
from tests.router.fakes import pending  # noqa: E402


def text_of(request: GenerateRequest | None = None) -> str | None:
    async def main() -> str | None:
        router = object.__new__(RayPrefixCacheAffinityRouter)  # no tree actor needed to read a request
        return router._extract_text_from_request(pending(request))

    return asyncio.run(main())


def test_completion_chat_and_non_generation_calls():
    params = SamplingParams(max_tokens=4)
    assert text_of(GenerateRequest("c", prompt="the same long system prompt", sampling_params=params)) == \
        "the same long system prompt"
    chat = GenerateRequest("m", messages=({"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}),
                           sampling_params=params)
    assert text_of(chat) == "be briefhi"
    assert text_of() is None  # model_info(): Ray's router then routes by power of two
