"""Multi-turn sessions: the traffic of a coding assistant, where each request resends the whole conversation.

A `Session` is one user's conversation in progress. Each turn adds a new user
message to the history and sends system prompt + history; the answer (its text,
as streamed) is appended before the next turn, so the context grows turn by turn
the way it does in Claude Code or Codex. The system prompt is the same text for
every user and session of the run (a shared, cacheable prefix); the messages are
unique per session, so only a channel's prompt cache for *this* conversation's
prefix can make later turns cheaper.

A turn that fails ends its session (a real assistant would retry, and tokenload
never retries silently); the user starts a new one.
"""

from __future__ import annotations

import random
from itertools import count

from tokenload.protocols.base import Conversation
from tokenload.tokens import synth_prompt
from tokenload.workload.sampling import Sampler
from tokenload.workload.scenario import SessionSection

# Seed offset of the shared system prompt, apart from [prompt] shared_prefix_tokens' seed.
_SYSTEM_SEED = 0x5E55


class Session:
    """One conversation: its id, planned number of turns, and the history so far."""

    __slots__ = ("session_id", "turns", "turn", "history", "_system", "_cache_control")

    def __init__(self, session_id: str, turns: int, system: str, cache_control: bool) -> None:
        self.session_id = session_id
        self.turns = turns
        self.turn = 0
        self.history: list[tuple[str, str]] = []
        self._system = system
        self._cache_control = cache_control

    @property
    def over(self) -> bool:
        return self.turn >= self.turns

    def ask(self, text: str) -> Conversation:
        """The next turn: `text` as the new user message after the history."""
        self.turn += 1
        self.history.append(("user", text))
        return Conversation(tuple(self.history), self._system, self._cache_control)

    def answered(self, text: str | None) -> None:
        """The turn's answer text, or None when the turn failed (which ends the session)."""
        if text is None:
            self.turns = self.turn
            return
        # An empty answer (thinking only, or a tool call) still takes its place: APIs require alternation.
        self.history.append(("assistant", text or "(no text)"))


class Sessions:
    """Per-process factory of sessions and their user messages (draws are seeded, texts unique)."""

    def __init__(self, section: SessionSection, seed: int, rng: random.Random) -> None:
        self.section = section
        self._turns = Sampler(section.turns, rng)
        self.user_tokens = Sampler(section.user_tokens, rng)
        self.system = synth_prompt(section.system_tokens, seed=seed ^ _SYSTEM_SEED) if section.system_tokens else ""
        self._n = count(1)

    @property
    def think_time_s(self) -> float:
        return self.section.think_time_s

    def new(self, user_id: str) -> Session:
        return Session(f"{user_id}-s{next(self._n)}", self._turns.draw(), self.system, self.section.cache_control)
