"""Anthropic Messages streaming (`POST {base}/v1/messages`).

Events: message_start (input usage) -> content_block_start / content_block_delta+ /
content_block_stop per block -> message_delta (stop_reason, CUMULATIVE
output_tokens) -> message_stop. `ping` and unknown event types are ignored.
Thinking blocks stream `thinking_delta` (a token) then `signature_delta` (not one).
"""

from __future__ import annotations

from typing import Any

from tokenload.measure import TOKEN_OTHER, TOKEN_TEXT, TOKEN_THINKING, Timeline
from tokenload.protocols.base import Conversation, ProtocolAdapter

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
            usage = (obj.get("message") or {}).get("usage") or {}
            if isinstance(usage.get("input_tokens"), int):
                tl.input_tokens = usage["input_tokens"] + sum(
                    usage.get(k) or 0 for k in ("cache_read_input_tokens", "cache_creation_input_tokens")
                )
            if isinstance(usage.get("cache_read_input_tokens"), int):
                tl.cache_read_tokens = usage["cache_read_input_tokens"]
            if isinstance(usage.get("cache_creation_input_tokens"), int):
                tl.cache_creation_tokens = usage["cache_creation_input_tokens"]
        elif kind == "message_delta":
            tl.stop_reason = (obj.get("delta") or {}).get("stop_reason") or tl.stop_reason
            usage = obj.get("usage") or {}
            if isinstance(usage.get("output_tokens"), int):
                tl.output_tokens = usage["output_tokens"]
        elif kind == "message_stop":
            tl.complete = True
        elif kind == "error":
            self.in_stream_error(obj, tl)
