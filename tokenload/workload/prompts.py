"""What each request asks for: prompt text, its token target, max_tokens and model.

Prompts are synthesised offline (`tokens.synth_prompt`) with a seed unique to the
request, so no two requests share text and a channel's prompt cache cannot
flatter TTFT, unless the scenario asks for a shared prefix. Channels count
tokens with their own tokenizer, so the generator self-calibrates: it keeps the
ratio of server-reported input tokens to its local estimate and scales the next
prompts by it, recording both the target and the server's count per request.
"""

from __future__ import annotations

import dataclasses
import random
from dataclasses import dataclass
from itertools import count

from tokenload.protocols.base import Conversation
from tokenload.record import RequestRecord
from tokenload.tokens import estimate_tokens, synth_prompt
from tokenload.workload.datasets import load_dataset
from tokenload.workload.design import Design, DesignCursor
from tokenload.workload.sampling import Sampler
from tokenload.workload.scenario import Scenario
from tokenload.workload.sessions import Session, Sessions
from tokenload.workload.traces import TraceRow

__all__ = ["Calibration", "PromptSource", "RequestPlan", "Sampler"]

# Calibration ratio bounds: a ratio outside them means the server counts something
# else entirely (images, a huge system prompt), and scaling by it would mislead.
_RATIO_BOUNDS = (0.25, 4.0)


@dataclass(frozen=True, slots=True)
class RequestPlan:
    """One request to send; `estimated_input_tokens` is the whole context (system and history included)."""

    model: str
    conversation: Conversation
    prompt_tokens_target: int
    estimated_input_tokens: int
    max_tokens: int
    session_id: str | None = None
    turn: int | None = None

    @property
    def prompt(self) -> str:
        """The newest user message."""
        return self.conversation.messages[-1][1]


class Calibration:
    """Running ratio server_input_tokens / local_estimate (ratio of sums: robust to outliers)."""

    __slots__ = ("server", "local")

    def __init__(self) -> None:
        self.server = 0
        self.local = 0

    def observe(self, server_tokens: int, local_estimate: int) -> None:
        if server_tokens > 0 and local_estimate > 0:
            self.server += server_tokens
            self.local += local_estimate

    def scaled(self, local_estimate: int) -> int:
        """A local estimate in the server's tokens (unchanged until a server count was observed)."""
        return max(1, round(local_estimate * self.ratio)) if local_estimate > 0 else local_estimate

    @property
    def ratio(self) -> float:
        if not self.local:
            return 1.0
        low, high = _RATIO_BOUNDS
        return min(high, max(low, self.server / self.local))


class PromptSource:
    """Per-process request generator; `salt` keeps processes' texts and draws apart."""

    def __init__(self, scenario: Scenario, models: tuple[str, ...], salt: int) -> None:
        rng = random.Random(f"{scenario.seed}:{salt}")
        self._rng = rng
        self._models = models
        self._salt = salt
        self._n = count()
        self._tokens = Sampler(scenario.prompt.tokens, rng) if scenario.prompt.tokens else None
        self._max_tokens = Sampler(scenario.output.max_tokens, rng)
        self._dataset = list(load_dataset(scenario.prompt.dataset)) if scenario.prompt.dataset else None
        if self._dataset is not None and scenario.prompt.order == "shuffle":
            random.Random(f"{scenario.seed}:dataset").shuffle(self._dataset)  # the same order in every process
        shared = scenario.prompt.shared_prefix_tokens
        self._prefix = synth_prompt(shared, seed=scenario.seed) if shared else ""
        self._calibrate = scenario.prompt.calibrate
        self.calibration = Calibration()
        self.sessions = Sessions(scenario.session, scenario.seed, rng) if scenario.session else None
        self._design = (Design(scenario.design, scenario.prompt.tokens, scenario.output.max_tokens, models, scenario.seed)
                        if scenario.design is not None and scenario.prompt.tokens is not None else None)
        self._cursors: dict[str, DesignCursor] = {}

    def next(self, session: Session | None = None, row: TraceRow | None = None, user: str = "") -> RequestPlan:
        """The next request: the next turn of `session`, a trace row's lengths, the next cell of `user`'s walk
        through the `[design]`, or an independent prompt."""
        n = next(self._n)
        if self._design is not None:
            cursor = self._cursors.get(user) or self._cursors.setdefault(user, self._design.cursor(user))
            cell = cursor.next()
            prompt = self._synth(cell.prompt_tokens, n, self._prefix)
            return RequestPlan(cell.model, Conversation.single(prompt), cell.prompt_tokens, estimate_tokens(prompt),
                               cell.max_tokens)
        model = self._models[0] if len(self._models) == 1 else self._rng.choice(self._models)
        max_tokens = self._max_tokens.draw()
        if row is not None:
            prompt = self._synth(row.input_tokens, n, self._prefix)
            return RequestPlan(model, Conversation.single(prompt), row.input_tokens, estimate_tokens(prompt),
                               row.output_tokens)
        if session is not None:
            assert self.sessions is not None
            text = self._synth(self.sessions.user_tokens.draw(), n, "")
            conversation = session.ask(text)
            estimate = conversation.estimated_tokens()
            return RequestPlan(model, conversation, estimate, estimate, max_tokens, session.session_id, session.turn)
        if self._dataset is not None:
            data = self._dataset[n % len(self._dataset)]
            *history, (_, text) = data.conversation.messages
            if not self._prefix:  # unique per request: a prompt cache may only reuse the row's history
                text = f"[{self._salt}-{n}] {text}"
            conversation = dataclasses.replace(data.conversation, messages=(*history, ("user", text)))
            estimate = conversation.estimated_tokens()
            return RequestPlan(model, conversation, estimate, estimate, data.max_tokens or max_tokens)
        assert self._tokens is not None
        target = self._tokens.draw()
        prompt = self._synth(target, n, self._prefix)
        return RequestPlan(model, Conversation.single(prompt), target, estimate_tokens(prompt), max_tokens)

    def _synth(self, target: int, n: int, prefix: str) -> str:
        """A unique synthetic text of about `target` server tokens (calibrated) starting with `prefix`."""
        local = target
        if self._calibrate:
            local = max(estimate_tokens(prefix) + 1, round(target / self.calibration.ratio))
        return synth_prompt(local, seed=(self._salt << 32) | n, prefix=prefix)

    def observe(self, record: RequestRecord, plan: RequestPlan) -> None:
        """Learn from a finished request's server-reported input tokens."""
        tokens = record.get("input_tokens")
        if record.get("input_tokens_source") == "server" and tokens:
            self.calibration.observe(tokens, plan.estimated_input_tokens)
