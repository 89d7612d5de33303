"""Protocol adapters: wire format in, token events out. One per API family."""

from __future__ import annotations

from tokenload.channel import Channel
from tokenload.protocols.anthropic import AnthropicMessages
from tokenload.protocols.base import PreparedRequest, ProtocolAdapter
from tokenload.protocols.openai_chat import OpenAIChat
from tokenload.protocols.openai_responses import OpenAIResponses

ADAPTERS: dict[str, type[ProtocolAdapter]] = {
    cls.name: cls for cls in (AnthropicMessages, OpenAIChat, OpenAIResponses)
}


def adapter_for(channel: Channel) -> ProtocolAdapter:
    """The adapter for the channel's protocol."""
    return ADAPTERS[channel.protocol](channel)


__all__ = ["ADAPTERS", "PreparedRequest", "ProtocolAdapter", "adapter_for"]
