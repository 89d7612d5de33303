"""OpenAI Responses streaming (`POST {base}/responses`), the API Codex uses.

Typed events with `sequence_number`, no `[DONE]`: output text arrives in
`response.output_text.delta`, reasoning in `response.reasoning_*text.delta`;
`response.completed` (or `response.incomplete`) carries usage and ends the
stream; `response.failed` and `error` are errors. A stream closed before the
final event is an error.
"""

from __future__ import annotations

from typing import Any

from tokenload.measure import TOKEN_OTHER, TOKEN_TEXT, TOKEN_THINKING, Timeline
from tokenload.protocols.base import ProtocolAdapter

_DELTA_KINDS = {
    "response.output_text.delta": TOKEN_TEXT,
    "response.reasoning_text.delta": TOKEN_THINKING,
    "response.reasoning_summary_text.delta": TOKEN_THINKING,
    "response.function_call_arguments.delta": TOKEN_OTHER,
}


class OpenAIResponses(ProtocolAdapter):
    name = "openai-responses"

    def body(self, prompt: str, max_tokens: int) -> dict[str, Any]:
        return {
            "model": self.channel.model,
            "max_output_tokens": max_tokens,
            "stream": True,
            "input": prompt,
        }

    def on_json(self, event: str, obj: dict[str, Any], t: float, tl: Timeline) -> None:
        kind = obj.get("type", event)
        token_kind = _DELTA_KINDS.get(kind)
        if token_kind is not None:
            delta = obj.get("delta")
            if delta and isinstance(delta, str):
                tl.token(t, token_kind, delta)
        elif kind in ("response.completed", "response.incomplete"):
            response = obj.get("response") or {}
            usage = response.get("usage") or {}
            if isinstance(usage.get("input_tokens"), int):
                tl.input_tokens = usage["input_tokens"]
            if isinstance(usage.get("output_tokens"), int):
                tl.output_tokens = usage["output_tokens"]
            cached = (usage.get("input_tokens_details") or {}).get("cached_tokens")
            if isinstance(cached, int):
                tl.cached_tokens = cached
            reasoning = (usage.get("output_tokens_details") or {}).get("reasoning_tokens")
            if isinstance(reasoning, int):
                tl.reasoning_tokens = reasoning
            incomplete = (response.get("incomplete_details") or {}).get("reason")
            tl.stop_reason = incomplete or response.get("status") or "completed"
            tl.complete = True
        elif kind in ("response.failed", "error"):
            self.in_stream_error(obj, tl)
