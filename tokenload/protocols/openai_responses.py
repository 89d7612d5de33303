"""OpenAI Responses streaming (`POST {base}/responses`), the API Codex uses.

Typed events with `sequence_number`, no `[DONE]`: output text arrives in
`response.output_text.delta`, reasoning in `response.reasoning_*text.delta`;
`response.completed` (or `response.incomplete`) carries usage and ends the
stream (a 0 there never replaces a count); `response.failed` and `error` are
errors. A stream closed before the final event is an error. The response's id
(`resp_...`) comes with `response.created` and again with the final event.
"""

from __future__ import annotations

from typing import Any

from tokenload.measure import TOKEN_OTHER, TOKEN_TEXT, TOKEN_THINKING, Timeline
from tokenload.protocols.base import Conversation, ProtocolAdapter, newer, stream_id

_DELTA_KINDS = {
    "response.output_text.delta": TOKEN_TEXT,
    "response.reasoning_text.delta": TOKEN_THINKING,
    "response.reasoning_summary_text.delta": TOKEN_THINKING,
    "response.function_call_arguments.delta": TOKEN_OTHER,
}


class OpenAIResponses(ProtocolAdapter):
    name = "openai-responses"
    delta_keys = (b'"delta":"',)
    ignored_numbers = (b'"sequence_number":',)

    def body(self, conversation: Conversation, max_tokens: int) -> dict[str, Any]:
        """A lone prompt goes as a plain `input` string; a history as input message items (stateless:
        no `previous_response_id`, so it works on relays that do not store responses)."""
        body: dict[str, Any] = {"model": self.channel.model, "max_output_tokens": max_tokens, "stream": True}
        if conversation.system:
            body["instructions"] = conversation.system
        messages = conversation.messages
        if len(messages) == 1 and messages[0][0] == "user":
            body["input"] = messages[0][1]
        else:
            body["input"] = [{"role": role, "content": text} for role, text in messages]
        return body

    def on_json(self, event: str, obj: dict[str, Any], t: float, tl: Timeline) -> None:
        kind = obj.get("type", event)
        token_kind = _DELTA_KINDS.get(kind)
        if token_kind is not None:
            delta = obj.get("delta")
            if delta and isinstance(delta, str):
                tl.token(t, token_kind, delta)
        elif kind == "response.created":
            stream_id(tl, (obj.get("response") or {}).get("id"))
        elif kind in ("response.completed", "response.incomplete"):
            response = obj.get("response") or {}
            stream_id(tl, response.get("id"))
            usage = response.get("usage") or {}
            tl.input_tokens = newer(tl.input_tokens, usage.get("input_tokens"))
            tl.output_tokens = newer(tl.output_tokens, usage.get("output_tokens"))
            reasoning = (usage.get("output_tokens_details") or {}).get("reasoning_tokens")
            tl.reasoning_tokens = newer(tl.reasoning_tokens, reasoning)
            cached = (usage.get("input_tokens_details") or {}).get("cached_tokens")
            tl.cache_read_tokens = newer(tl.cache_read_tokens, cached)
            incomplete = (response.get("incomplete_details") or {}).get("reason")
            tl.stop_reason = incomplete or response.get("status") or "completed"
            tl.complete = True
        elif kind in ("response.failed", "error"):
            self.in_stream_error(obj, tl)
