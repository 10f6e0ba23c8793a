"""The ingress tokenizes once (the engine's own InputProcessor, real tokenizer): token ids travel with
the request and are exactly what the engine would have made; the engine uses them without its
tokenizer; bad prompts fail at the ingress with the engine's 400; API keys salt the prefix cache."""

from __future__ import annotations

import asyncio

import httpx

from serve_app.backends.base import ModelInfo
from serve_app.input_processor import InputProcessor
from serve_app.serving.api import OpenAIAPI, build_fastapi_app
from serve_app.serving.config import ServeConfig
from serve_app.serving.ingress import make_input_processor
from serve_app.types import GenerateRequest
from tests.serving.conftest import MODEL_DIR
from tests.serving.test_api_unit import FakeHandle, ok_script

INFO = ModelInfo(name="m", max_model_len=64, backend="fake")
MESSAGES = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Capital of France?"}]


def client(handle: FakeHandle, **config) -> tuple[httpx.AsyncClient, InputProcessor]:
    cfg = ServeConfig(model=str(MODEL_DIR), **config)
    processor = make_input_processor(cfg, INFO)
    app = build_fastapi_app(OpenAIAPI(handle, cfg, INFO, processor), api_key="")
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test", timeout=30), processor


def test_token_ids_are_the_engines_and_the_engine_does_not_tokenize_again():
    async def main():
        handle = FakeHandle(ok_script)
        c, processor = client(handle)
        async with c:
            r = await c.post("/v1/chat/completions", json={"model": "m", "messages": MESSAGES, "n": 2})
            assert r.status_code == 200, r.text
            r = await c.post("/v1/completions", json={"model": "m", "prompt": ["Hello there", "General Kenobi"]})
            assert r.status_code == 200, r.text
            # too long for the context: the engine's own 400, from the ingress, before any replica call
            r = await c.post("/v1/completions", json={"model": "m", "prompt": "word " * 80})
            assert r.status_code == 400 and r.json()["error"]["param"] == "prompt", r.text
        chat, _, first, second = handle.calls
        assert len(handle.calls) == 4
        expected = tuple(processor.apply_chat_template(MESSAGES))
        assert chat.prompt_token_ids == expected and chat.messages == tuple(MESSAGES)  # text kept for other routers
        assert first.prompt_token_ids == tuple(processor.tokenize("Hello there"))
        assert second.prompt_token_ids == tuple(processor.tokenize("General Kenobi"))
        # the replica's engine takes the ids as they are: no tokenizer needed
        engine = InputProcessor(str(MODEL_DIR), 49152, 64)
        engine.hf_tokenizer = None
        assert engine.process(chat).prompt_token_ids == expected

    asyncio.run(main())


def test_api_keys_salt_the_prefix_cache_when_asked():
    async def main():
        handle = FakeHandle(ok_script)
        c, _ = client(handle, prefix_cache_salt="api_key")
        async with c:
            for key in ("key-a", "key-a", "key-b"):
                r = await c.post("/v1/completions", json={"model": "m", "prompt": "hi"}, headers={"Authorization": f"Bearer {key}"})
                assert r.status_code == 200, r.text
        a1, a2, b = (call.cache_salt for call in handle.calls)
        assert a1 == a2 and a1 != b and a1 is not None and "key-a" not in a1
        shared = FakeHandle(ok_script)
        c, _ = client(shared)
        async with c:
            await c.post("/v1/completions", json={"model": "m", "prompt": "hi"}, headers={"Authorization": "Bearer key-a"})
        assert shared.calls[0].cache_salt is None
        salted = GenerateRequest("r", prompt="hi", prompt_token_ids=(1, 2), cache_salt=a1)
        assert InputProcessor(str(MODEL_DIR), 49152, 64).process(salted).cache_salt == a1.encode()

    asyncio.run(main())
