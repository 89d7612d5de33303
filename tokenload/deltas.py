"""Token deltas recognised by their shape: a JSON parse for the first of each shape, a byte compare after.

Within one stream every content delta is the same bytes around a different
string: `data: {"id":"chatcmpl-1",...,"delta":{"content":"` + text + `"},...}`.
Decoding the SSE lines and parsing the JSON of each such event costs about four
times what the rest of reading a token does. So a stream's events go through the
full path (SSE decoder, JSON, protocol adapter) until one of them turns out to be
exactly one token of some kind and nothing else (no stop reason, usage, error or
malformed count); its bytes before and after the delta's string value become a
shape. A later event with that same prefix and suffix, and between them a
non-empty, valid JSON string body, is that same kind of token without a parse.

Why that is exact: such an event is the learned one with only the string's value
changed, and an adapter reads a delta's value only through "is it a non-empty
string" (see `ProtocolAdapter.delta_keys`); a value that would decode to anything
else (a quote, a bad escape, a control character) fails the body check and takes
the full path. Numbers an adapter ignores and that change per event (the
Responses API's `sequence_number`) are blanked before the compare.
"""

from __future__ import annotations

import re
from typing import Any

from tokenload.measure import TOKEN_OTHER, TOKEN_TEXT, TOKEN_THINKING, Timeline

# A JSON string's body between its quotes, at least one character: what json.loads accepts (strict mode).
_BODY = re.compile(rb'(?:[^"\\\x00-\x1f]|\\["\\/bfnrt]|\\u[0-9a-fA-F]{4})+')
_full = _BODY.fullmatch
_MAX_SHAPES = 8  # per stream: text, thinking, tool input, and slack for servers that vary a field


def _observed(tl: Timeline) -> tuple[Any, ...]:
    """Everything an event can change on a timeline besides the token counts and times."""
    return (tl.stop_reason, tl.input_tokens, tl.output_tokens, tl.reasoning_tokens, tl.cache_read_tokens,
            tl.cache_creation_tokens, tl.complete, tl.malformed, tl.error_kind, tl.request_id)


class DeltaShapes:
    """The learned delta shapes of one stream (per stream: the prefix holds the stream's own ids)."""

    __slots__ = ("_blank", "_keys", "_shapes")

    def __init__(self, keys: tuple[bytes, ...], blank: tuple[bytes, ...] = ()) -> None:
        self._keys = keys
        self._blank = blank
        # (prefix, suffix, len(prefix), len(suffix), len(prefix + suffix), kind)
        self._shapes: list[tuple[bytes, bytes, int, int, int, str]] = []

    def match(self, block: bytes) -> str | None:
        """The token kind of one SSE event's bytes (blank line excluded) when it has a learned shape."""
        if self._blank:
            block = self._normalise(block)
        size = len(block)
        for prefix, suffix, head, tail, fixed, kind in self._shapes:
            if size > fixed and block.startswith(prefix) and block.endswith(suffix) and _full(block, head, size - tail):
                return kind
        return None

    def before(self, tl: Timeline) -> tuple[Any, ...]:
        """What to pass to `learn` after the block went through the full path."""
        return (tl.text_chunks, tl.thinking_chunks, tl.other_chunks, _observed(tl))

    def learn(self, block: bytes, before: tuple[Any, ...], tl: Timeline) -> None:
        """Keep `block`'s shape if the full path made it exactly one token and nothing else."""
        text, thinking, other, observed = before
        added = (tl.text_chunks - text, tl.thinking_chunks - thinking, tl.other_chunks - other)
        if sum(added) != 1 or len(self._shapes) >= _MAX_SHAPES or _observed(tl) != observed:
            return
        kind = (TOKEN_TEXT, TOKEN_THINKING, TOKEN_OTHER)[added.index(1)]
        if self._blank:
            block = self._normalise(block)
        for key in self._keys:
            at = block.find(key)
            if at < 0 or block.find(key, at + 1) >= 0:
                continue
            start = at + len(key)
            body = _BODY.match(block, start)
            if body is None or block[body.end() : body.end() + 1] != b'"':
                continue
            prefix, suffix = block[:start], block[body.end() :]
            self._shapes.append((prefix, suffix, len(prefix), len(suffix), len(prefix) + len(suffix), kind))
            return

    def _normalise(self, block: bytes) -> bytes:
        for key in self._blank:
            at = block.find(key)
            if at >= 0:
                start = end = at + len(key)
                while block[end : end + 1].isdigit():
                    end += 1
                block = block[:start] + block[end:]
        return block
