"""SSE events from the precomputed template are byte for byte what the generic encoder makes."""

from __future__ import annotations

import json

import pytest

from serve_app.serving.responses import ResponseBuilder
from serve_app.serving.stream_batching import GenerationChunk


@pytest.mark.parametrize("kind", ["completion", "chat"])
@pytest.mark.parametrize("include_usage", [False, True])
@pytest.mark.parametrize("text, finished, reason", [("hé \"quoted\"\n\\ 中文 \u2028", False, None), (" the", True, "length"),
                                                    ("", True, "stop"), ("x", True, "abort")])
def test_template_event_equals_the_generic_event(kind, include_usage, text, finished, reason):
    builder = ResponseBuilder(kind, 'cmpl-"odd"\nid', "modèle/名前", include_usage)
    event = builder.chunk_event(3, GenerationChunk(text, (1, 2), finished, reason, 7))
    if kind == "completion":
        choice = {"index": 3, "text": text, "logprobs": None, "finish_reason": reason}
    else:
        choice = {"index": 3, "delta": {"content": text} if text else {}, "logprobs": None, "finish_reason": reason}
    assert event == builder._event([choice])
    body = json.loads(event.removeprefix("data: "))
    assert body["choices"][0]["finish_reason"] == reason and ("usage" in body) == include_usage
