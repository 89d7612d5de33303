"""OpenAI Chat Completions streaming (`POST {base}/chat/completions`).

Content arrives in `choices[0].delta.content`; reasoning models send
`delta.reasoning_content` or `delta.reasoning`. The role-only first chunk that
vLLM sends after prefill is not a token. With `stream_options.include_usage`
one chunk with empty (or null) `choices` carries usage before `data: [DONE]`
(vLLM's `continuous_usage_stats` sends it on every chunk: the later count wins, and
a 0 never replaces a count). Every chunk carries the completion's id (`chatcmpl-...`).
A line with a top-level `error` key is an in-stream error.
"""

from __future__ import annotations

from typing import Any

from tokenload.measure import TOKEN_OTHER, TOKEN_TEXT, TOKEN_THINKING, Timeline
from tokenload.protocols.base import Conversation, ProtocolAdapter, newer, stream_id


class OpenAIChat(ProtocolAdapter):
    name = "openai-chat"
    delta_keys = (b'"content":"', b'"reasoning_content":"', b'"reasoning":"', b'"arguments":"')

    def body(self, conversation: Conversation, max_tokens: int) -> dict[str, Any]:
        system = [{"role": "system", "content": conversation.system}] if conversation.system else []
        return {
            "model": self.channel.model,
            "max_tokens": max_tokens,
            "stream": True,
            "stream_options": {"include_usage": True},
            "messages": system + [{"role": role, "content": text} for role, text in conversation.messages],
        }

    def on_done(self, tl: Timeline) -> None:
        tl.complete = True

    def on_json(self, event: str, obj: dict[str, Any], t: float, tl: Timeline) -> None:
        if "error" in obj and obj["error"]:
            self.in_stream_error(obj, tl)
            return
        if tl.request_id is None:
            stream_id(tl, obj.get("id"))
        for choice in obj.get("choices") or ():
            delta = choice.get("delta") or {}
            text = delta.get("content")
            if text and isinstance(text, str):
                tl.token(t, TOKEN_TEXT, text)
            thinking = delta.get("reasoning_content") or delta.get("reasoning")
            if thinking and isinstance(thinking, str):
                tl.token(t, TOKEN_THINKING, thinking)
            if delta.get("tool_calls"):
                tl.token(t, TOKEN_OTHER)
            if choice.get("finish_reason"):
                tl.stop_reason = choice["finish_reason"]
        usage = obj.get("usage")
        if isinstance(usage, dict):
            tl.input_tokens = newer(tl.input_tokens, usage.get("prompt_tokens"))
            tl.output_tokens = newer(tl.output_tokens, usage.get("completion_tokens"))
            details = usage.get("completion_tokens_details") or {}
            tl.reasoning_tokens = newer(tl.reasoning_tokens, details.get("reasoning_tokens"))
            cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
            tl.cache_read_tokens = newer(tl.cache_read_tokens, cached)

    def finish(self, tl: Timeline) -> None:
        # Some backends end with a finish_reason but no `[DONE]`: complete enough.
        if tl.stop_reason is not None:
            tl.complete = True
        super().finish(tl)
