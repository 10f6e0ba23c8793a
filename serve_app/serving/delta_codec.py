"""The wire format of multiplexed stream deltas (replica → ingress): msgpack, data only.

A frame is a msgpack array of `[request_id, chunk]` pairs, each chunk the fields of a
`GenerationChunk` as an array: text, token ids, finished, finish reason (or nil), prompt tokens,
cached tokens, logprobs (nil, or one `[token_id, token, logprob, [[id, text, logprob], ...]]` per
token). Decoding builds nothing but strings, numbers, booleans and arrays (no extension types, no
object hooks), checks every field's type and raises `FrameError` on anything else: a garbled or
hostile frame can fail its connection, never run code or build objects the ingress did not ask for.
"""

from __future__ import annotations

import msgpack

from serve_app.serving.stream_batching import GenerationChunk
from serve_app.types import TokenLogprob


class FrameError(ValueError):
    """A frame that is not a well-formed batch of deltas."""


def encode_batch(items: list[tuple[str, GenerationChunk]]) -> bytes:
    """(request id, chunk) pairs as one frame."""
    return msgpack.packb([(request_id, (c.text, c.token_ids, c.finished, c.finish_reason, c.num_prompt_tokens,
                                        c.num_cached_tokens, _pack_logprobs(c.logprobs))) for request_id, c in items])


def decode_batch(blob: bytes) -> list[tuple[str, GenerationChunk]]:
    """The pairs `encode_batch` wrote; `FrameError` for anything else."""
    try:
        # extension types are refused outright; container sizes are bounded by the frame's own size
        items = msgpack.unpackb(blob, use_list=False, raw=False, strict_map_key=True, ext_hook=_no_ext)
    except FrameError:
        raise
    except Exception as exc:  # msgpack raises several unrelated types for malformed input
        raise FrameError(f"undecodable frame: {type(exc).__name__}") from None
    _expect(isinstance(items, tuple), "a frame is an array of [request id, chunk] pairs")
    return [_item(item) for item in items]


def _no_ext(code: int, data: bytes) -> None:
    raise FrameError(f"extension type {code} in a frame")


def _expect(condition: bool, what: str) -> None:
    if not condition:
        raise FrameError(what)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _item(item: object) -> tuple[str, GenerationChunk]:
    _expect(isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], str), "an item is [request id, chunk]")
    request_id, fields = item
    _expect(isinstance(fields, tuple) and len(fields) == 7, "a chunk has 7 fields")
    text, token_ids, finished, reason, num_prompt, num_cached, logprobs = fields
    _expect(isinstance(text, str), "text: a string")
    _expect(isinstance(token_ids, tuple) and all(_is_int(t) for t in token_ids), "token ids: integers")
    _expect(isinstance(finished, bool), "finished: a boolean")
    _expect(reason is None or isinstance(reason, str), "finish reason: a string or nil")
    _expect(_is_int(num_prompt) and _is_int(num_cached), "token counts: integers")
    return request_id, GenerationChunk(text, token_ids, finished, reason, num_prompt, num_cached, _unpack_logprobs(logprobs))


def _pack_logprobs(logprobs: tuple[TokenLogprob, ...] | None) -> list | None:
    if logprobs is None:
        return None
    return [(lp.token_id, lp.token, lp.logprob, lp.top) for lp in logprobs]


def _unpack_logprobs(packed: object) -> tuple[TokenLogprob, ...] | None:
    if packed is None:
        return None
    _expect(isinstance(packed, tuple), "logprobs: an array")
    out = []
    for entry in packed:
        _expect(isinstance(entry, tuple) and len(entry) == 4, "a logprob entry has 4 fields")
        token_id, token, logprob, top = entry
        _expect(_is_int(token_id) and isinstance(token, str) and isinstance(logprob, float) and isinstance(top, tuple),
                "a logprob entry is [id, text, logprob, top]")
        for alt in top:
            _expect(isinstance(alt, tuple) and len(alt) == 3 and _is_int(alt[0]) and isinstance(alt[1], str)
                    and isinstance(alt[2], float), "a top entry is [id, text, logprob]")
        out.append(TokenLogprob(token_id, token, logprob, top))
    return tuple(out)
