"""An independent inference server for tests: N batch slots, a FIFO queue, known prefill and decode times.

Each request waits for a free slot (the wait is part of its TTFT, as on a real
server), then its first token comes `ttft_base_s + ttft_per_token_s x prompt
tokens` later and each further token `tpot_s` after the previous one. Prompt
tokens are counted with tokenload's own offline estimate, which its synthetic
prompts match exactly. It speaks OpenAI Chat Completions streaming (the
scripted streams of `fakeserver`), so its capacity is known by construction:
with closed-loop users, up to `slots` users never queue.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from fakeserver import FakeServer, Received, Script, chat_stream

from tokenload.tokens import estimate_tokens


class SlotServer(FakeServer):
    def __init__(self, slots: int, ttft_base_s: float, ttft_per_token_s: float, tpot_s: float) -> None:
        self.slots = slots
        self.ttft_base_s = ttft_base_s
        self.ttft_per_token_s = ttft_per_token_s
        self.tpot_s = tpot_s
        self.busy = 0
        self.max_busy = 0
        self.ttfts: list[float] = []  # each answer's first token from its request's arrival, the slot wait included
        self._slots: asyncio.Semaphore | None = None
        super().__init__()
        self.route(self._script)

    def _script(self, received: Received) -> Script:
        body = received.json()
        text = " ".join(str(m.get("content", "")) for m in body.get("messages", []))
        n_in = estimate_tokens(text)
        n_out = int(body.get("max_tokens") or body.get("max_completion_tokens") or 16)
        writes = chat_stream(["tok "] * n_out, self.ttft_base_s + self.ttft_per_token_s * n_in, self.tpot_s,
                             input_tokens=n_in, output_tokens=n_out, finish_reason="length")
        return Script(writes=writes)

    async def _answer(self, script: Script, reader: Any, writer: Any, release: Any,
                      written: list[tuple[float, float]]) -> None:
        if self._slots is None:  # created on the server's own loop
            self._slots = asyncio.Semaphore(self.slots)
        arrival = time.monotonic()
        async with self._slots:
            # the role chunk goes at once, the first token after its delay
            self.ttfts.append(time.monotonic() - arrival + sum(delay for delay, _ in script.writes[:2]))
            self.busy += 1
            self.max_busy = max(self.max_busy, self.busy)
            try:
                await super()._answer(script, reader, writer, release, written)
            finally:
                self.busy -= 1
