"""Prompt datasets: the formats other benchmarks use, read into one shape and validated up front.

One request per row. The format is told by each row's shape, so the files that
vLLM's bench, GuideLLM and fine-tuning pipelines already have load as they are:

- plain JSONL: `{"prompt": "..."}` (or `"text"`);
- OpenAI-chat JSONL: `{"messages": [{"role": "system" | "user" | "assistant", "content": ...}]}`;
- Anthropic JSONL: `{"system": ..., "messages": [{"role": "user" | "assistant", "content": ...}]}`;
- ShareGPT: `{"conversations": [{"from": "human" | "gpt" | "system", "value": "..."}]}`, as a JSON
  array (the usual `.json` download) or one object per line.

Content may be a string or a list of blocks (their `text` parts are sent). A
row's history is sent up to its last user message; a trailing assistant reply
(ShareGPT, chat fine-tuning data) sets the row's output length, as in vLLM's
ShareGPT benchmark, unless the row gives `max_tokens` / `output_tokens` itself.
Any mistake is one `ConfigError` naming the file and the line (or array item).
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tokenload.errors import ConfigError
from tokenload.protocols.base import Conversation
from tokenload.tokens import estimate_tokens

ROLES = {"user": "user", "human": "user", "assistant": "assistant", "gpt": "assistant", "chatgpt": "assistant",
         "model": "assistant", "system": "system"}
OUTPUT_KEYS = ("max_tokens", "output_tokens")
_SHAPES = '{"prompt": ...}, {"messages": [...]} or {"conversations": [...]}'


@dataclass(frozen=True, slots=True)
class DatasetRow:
    """One request of a dataset: what to send and, when the row says, how many tokens to ask for."""

    conversation: Conversation
    max_tokens: int | None = None

    @property
    def prompt(self) -> str:
        """The last user message."""
        return self.conversation.messages[-1][1]


class _RowError(ValueError):
    """A row that is not one of the formats; the caller adds file and line."""


def _text(content: Any) -> str:
    """A message content (string, or blocks with text parts) as one string."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = [b if isinstance(b, str) else b.get("text") if isinstance(b, dict) else None for b in content]
        return "\n".join(p for p in parts if isinstance(p, str))
    raise _RowError(f"message content must be a string or a list of blocks, got {type(content).__name__}")


def _turns(items: Any, role_key: str, text_key: str) -> list[tuple[str, str]]:
    if not isinstance(items, list) or not items:
        raise _RowError(f"expected a non-empty list of messages, got {json.dumps(items)[:40]}")
    turns = []
    for i, item in enumerate(items, 1):
        if not isinstance(item, dict) or ROLES.get(str(item.get(role_key)).lower()) is None:
            raise _RowError(f"message {i}: expected an object with {role_key!r} one of "
                            f"{', '.join(sorted(ROLES))}")
        turns.append((ROLES[str(item[role_key]).lower()], _text(item.get(text_key))))
    return turns


def parse_row(obj: Any) -> DatasetRow:
    """One row in any supported format; raises `_RowError` naming what is wrong."""
    if not isinstance(obj, dict):
        raise _RowError(f"expected an object like {_SHAPES}")
    if "conversations" in obj:
        turns = _turns(obj["conversations"], "from", "value")
    elif "messages" in obj:
        turns = _turns(obj["messages"], "role", "content")
        if obj.get("system"):
            turns.insert(0, ("system", _text(obj["system"])))
    else:
        prompt = obj.get("prompt", obj.get("text"))
        if not isinstance(prompt, str) or not prompt:
            raise _RowError(f"expected an object like {_SHAPES}")
        turns = [("user", prompt)]
    system = "\n\n".join(text for role, text in turns if role == "system")
    messages = [(role, text) for role, text in turns if role != "system" and text]
    while messages and messages[0][0] != "user":  # APIs want the user first (ShareGPT rows may open with the bot)
        messages.pop(0)
    reply = None
    while messages and messages[-1][0] == "assistant":
        reply = messages.pop()[1]
    if not messages:
        raise _RowError("no non-empty user message to send")
    max_tokens = next((obj[k] for k in OUTPUT_KEYS if k in obj), None)
    if max_tokens is not None and (isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1):
        raise _RowError(f"max_tokens / output_tokens must be an integer >= 1, got {json.dumps(max_tokens)}")
    if max_tokens is None and reply:
        max_tokens = max(1, estimate_tokens(reply))
    return DatasetRow(Conversation(tuple(messages), system), max_tokens)


@functools.lru_cache(maxsize=4)
def load_dataset(path: str) -> tuple[DatasetRow, ...]:
    """Every row of a dataset file (cached: the scenario check and each load process read it once)."""
    source = Path(path)
    try:
        text = source.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"dataset {path}: cannot read: {exc}") from None
    rows: list[DatasetRow] = []
    if text.lstrip().startswith("["):  # a JSON array (ShareGPT's usual download)
        try:
            items = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ConfigError(f"dataset {path} line {exc.lineno}: not valid JSON: {exc.msg}") from None
        for n, item in enumerate(items, 1):
            try:
                rows.append(parse_row(item))
            except _RowError as exc:
                raise ConfigError(f"dataset {path} item {n}: {exc}") from None
    else:
        for n, line in enumerate(text.splitlines(), 1):
            if not line.strip():
                continue
            try:
                rows.append(parse_row(json.loads(line)))
            except json.JSONDecodeError as exc:
                raise ConfigError(f"dataset {path} line {n}: not valid JSON: {exc.msg}") from None
            except _RowError as exc:
                raise ConfigError(f"dataset {path} line {n}: {exc}") from None
    if not rows:
        raise ConfigError(f"dataset {path} holds no prompts")
    return tuple(rows)
