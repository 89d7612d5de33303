"""Anthropic Messages streaming (`POST {base}/v1/messages`).

Events: message_start (the message id, input usage) -> content_block_start /
content_block_delta+ / content_block_stop per block -> message_delta (stop_reason,
CUMULATIVE usage: output_tokens, and on newer servers and relays the input and cache
counts too) -> message_stop. `ping` and unknown event types are ignored. Thinking
blocks stream `thinking_delta` (a token) then `signature_delta` (not one).

Usage is read from both usage events and the later count wins, but a 0 never replaces a
count: LiteLLM's Anthropic route sends `input_tokens: 0` in message_start and the real
input and cache counts in message_delta. `input_tokens` is recorded as the whole prompt
(Anthropic's uncached `input_tokens` + cache reads + cache writes, as OpenAI counts it),
the cache counts in their own columns. message_start's `output_tokens` (1 or so) is not
the answer's count and is not read.
"""

from __future__ import annotations

from typing import Any

from tokenload.measure import TOKEN_OTHER, TOKEN_TEXT, TOKEN_THINKING, Timeline
from tokenload.protocols.base import Conversation, ProtocolAdapter, newer, stream_id, usage_count

_EPHEMERAL = {"type": "ephemeral"}

_DELTA_KINDS = {
    "text_delta": ("text", TOKEN_TEXT),
    "thinking_delta": ("thinking", TOKEN_THINKING),
    "input_json_delta": ("partial_json", TOKEN_OTHER),
}


class AnthropicMessages(ProtocolAdapter):
    name = "anthropic"
    delta_keys = (b'"text":"', b'"thinking":"', b'"partial_json":"')

    def body(self, conversation: Conversation, max_tokens: int) -> dict[str, Any]:
        cache = conversation.cache_control
        messages: list[dict[str, Any]] = [{"role": role, "content": text} for role, text in conversation.messages]
        if cache:  # breakpoint on the newest message: the next turn reads everything up to here
            last = messages[-1]
            last["content"] = [{"type": "text", "text": last["content"], "cache_control": _EPHEMERAL}]
        body: dict[str, Any] = {"model": self.channel.model, "max_tokens": max_tokens, "stream": True}
        if conversation.system:
            block: dict[str, Any] = {"type": "text", "text": conversation.system}
            if cache:
                block["cache_control"] = _EPHEMERAL
            body["system"] = [block]
        body["messages"] = messages
        return body

    def on_json(self, event: str, obj: dict[str, Any], t: float, tl: Timeline) -> None:
        kind = obj.get("type", event)
        if kind == "content_block_delta":
            delta = obj.get("delta") or {}
            field_kind = _DELTA_KINDS.get(delta.get("type", ""))
            text = delta.get(field_kind[0]) if field_kind else None
            if field_kind and text and isinstance(text, str):
                tl.token(t, field_kind[1], text)
        elif kind == "message_start":
            message = obj.get("message") or {}
            stream_id(tl, message.get("id"))
            _usage(message.get("usage") or {}, tl, output=False)
        elif kind == "message_delta":
            tl.stop_reason = (obj.get("delta") or {}).get("stop_reason") or tl.stop_reason
            _usage(obj.get("usage") or {}, tl, output=True)
        elif kind == "message_stop":
            tl.complete = True
        elif kind == "error":
            self.in_stream_error(obj, tl)


def _usage(usage: dict[str, Any], tl: Timeline, *, output: bool) -> None:
    """One usage object (see the module docstring): cache counts first, then the prompt's total from them."""
    tl.cache_read_tokens = newer(tl.cache_read_tokens, usage.get("cache_read_input_tokens"))
    tl.cache_creation_tokens = newer(tl.cache_creation_tokens, usage.get("cache_creation_input_tokens"))
    uncached = usage_count(usage.get("input_tokens"))
    if uncached is not None:
        tl.input_tokens = newer(tl.input_tokens,
                                uncached + (tl.cache_read_tokens or 0) + (tl.cache_creation_tokens or 0))
    if output:
        tl.output_tokens = newer(tl.output_tokens, usage.get("output_tokens"))
