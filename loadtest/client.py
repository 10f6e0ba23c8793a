"""The benchmarks' HTTP client: streamed OpenAI completions over one pooled aiohttp session, timed at the client
(TTFT, the arrival of every event with text, TPOT, tokens); `Stream` parses any SSE completion stream (the
locustfile's too). aiohttp, not httpx: httpcore 1.0's pool walks every pooled connection, and for each the
whole pool again, whenever a request starts or ends (with 256 connections the client's CPU per token doubled).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from loadtest.stats import percentile


@dataclass
class Stream:
    """One streamed completion as the client saw it (seconds on one clock from `start`). `error`: the
    server's error code (HTTP status or error event) or the transport exception's name; None if fine."""

    start: float
    status: int | None = None
    error: str | None = None
    end: float | None = None
    token_times: list[float] = field(default_factory=list)  # every event that carried text
    tokens: int = 0  # the final usage's completion_tokens (else one per text event)
    prompt_tokens: int | None = None  # the final usage's
    text: list[str] = field(default_factory=list)
    finished: bool = False  # a choice said why it finished
    done: bool = False  # the stream ended with `data: [DONE]`

    @property
    def ttft_s(self) -> float | None:
        return self.token_times[0] - self.start if self.token_times else None

    @property
    def tpot_s(self) -> float | None:
        """Mean time per output token after the first."""
        return (self.end - self.token_times[0]) / (self.tokens - 1) if self.token_times and self.end and self.tokens > 1 else None

    @property
    def empty_reply(self) -> bool:
        """Ended properly, saying why it finished, with no text at all (the model's first token was its end)."""
        return self.done and self.finished and not self.token_times

    def feed(self, line: bytes, now: float) -> None:
        """One SSE line (chat or text completions)."""
        data = line[5:].strip() if line.startswith(b"data:") else None
        if data == b"[DONE]":
            self.done = True
        if not data or data == b"[DONE]":
            return
        payload = json.loads(data)
        if "error" in payload:
            error = payload["error"]
            self.error = str(error.get("code") or error.get("message")) if isinstance(error, dict) else str(error)
        if usage := payload.get("usage"):
            self.tokens, self.prompt_tokens = usage["completion_tokens"], usage.get("prompt_tokens")
        choices = payload.get("choices") or ()
        self.finished |= any(c.get("finish_reason") for c in choices)
        if texts := [t for c in choices if (t := c.get("text") or (c.get("delta") or {}).get("content"))]:
            self.text += texts
            self.token_times.append(now)
            self.tokens = self.tokens if payload.get("usage") else max(self.tokens, len(self.token_times))


class Completions:
    """POST {base_url}/v1/completions, streamed, greedy, `ignore_eos` (a server extension ours and vLLM's have)."""

    def __init__(self, base_url: str, model: str) -> None:
        self.base_url, self.model, self._session = base_url.rstrip("/"), model, None

    def _client(self):
        """The session, opened on the event loop of the first call (an aiohttp session belongs to one loop)."""
        import aiohttp

        if self._session is None:
            self._session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=1024), timeout=aiohttp.ClientTimeout(total=600))
        return self._session

    def body(self, prompt: list[int] | str, max_tokens: int) -> dict[str, Any]:
        return {"model": self.model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
                "stream": True, "stream_options": {"include_usage": True}}

    async def raw_stream(self, prompt: list[int] | str, max_tokens: int) -> Stream:
        """One streamed completion read the cheapest way: the time of every read as an event, no parsing but the
        final usage in the stream's tail; raises on an error."""
        s, tail = Stream(time.perf_counter()), b""
        async with self._client().post(self.base_url + "/v1/completions", json=self.body(prompt, max_tokens)) as r:
            r.raise_for_status()
            async for raw in r.content.iter_any():
                s.token_times.append(time.perf_counter())
                tail = (tail + raw)[-4096:]
        s.end, text = time.perf_counter(), tail.decode(errors="replace")
        if '"error"' in text:
            raise RuntimeError(f"stream error: {text[-500:]}")
        s.tokens = int(text.rsplit('"completion_tokens":', 1)[1].split(",", 1)[0])
        return s

    async def stream(self, prompt: list[int] | str, max_tokens: int) -> Stream:
        """One streamed completion; never raises for what the server or the connection did (see `Stream.error`)."""
        s, buffer = Stream(time.perf_counter()), b""
        try:
            async with self._client().post(self.base_url + "/v1/completions", json=self.body(prompt, max_tokens)) as r:
                s.status = r.status
                if r.status != 200:
                    with contextlib.suppress(Exception):  # an OpenAI error body names its code
                        s.error = str((await r.json())["error"]["code"])
                    s.error = s.error or str(r.status)
                else:
                    async for raw in r.content.iter_any():
                        now = time.perf_counter()
                        *lines, buffer = (buffer + raw).split(b"\n")
                        for line in lines:
                            s.feed(line.strip(), now)
        except Exception as exc:  # noqa: BLE001 - a dropped connection is an outcome like any other
            s.error = type(exc).__name__
        s.end = time.perf_counter()
        return s

    async def get(self, path: str) -> None:
        """GET {base_url}{path}; raises on a non-2xx status."""
        async with self._client().get(self.base_url + path) as r:
            r.raise_for_status()
            await r.read()

    async def aclose(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None


async def burst(stream: Callable[[list[int], int], Awaitable[Stream]], prompts: list[list[int]], max_tokens: int) -> dict[str, Any]:
    """Every prompt streamed at once: output tok/s, TTFT p50/p99, the gaps between a stream's events from its second on
    (the one before spans the other streams' prefill) p50/p99, events per token; raises on a failed or short stream."""
    start = time.perf_counter()
    streams = await asyncio.gather(*(stream(p, max_tokens) for p in prompts))
    elapsed, tokens = time.perf_counter() - start, sum(s.tokens for s in streams)
    if tokens != len(prompts) * max_tokens or any(s.error for s in streams):
        raise RuntimeError(f"{tokens} output tokens, expected {len(prompts) * max_tokens}; errors {[s.error for s in streams if s.error][:3]}")
    ttfts, gaps = [s.ttft_s for s in streams], [b - a for s in streams for a, b in itertools.pairwise(s.token_times[1:])]
    return {"output_tok_s": tokens / elapsed, "elapsed_s": elapsed, "output_tokens": tokens, "ttft_p50_s": percentile(ttfts, 0.5),
            "ttft_p99_s": percentile(ttfts, 0.99), "itl_p50_s": percentile(gaps, 0.5), "itl_p99_s": percentile(gaps, 0.99),
            "events_per_token": sum(len(s.token_times) for s in streams) / tokens}
