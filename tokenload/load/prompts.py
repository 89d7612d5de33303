"""What each request asks for: prompt text, its token target, max_tokens and model.

Prompts are synthesised offline (`tokens.synth_prompt`) with a seed unique to the
request, so no two requests share text and a channel's prompt cache cannot
flatter TTFT, unless the scenario asks for a shared prefix. Channels count
tokens with their own tokenizer, so the generator self-calibrates: it keeps the
ratio of server-reported input tokens to its local estimate and scales the next
prompts by it, recording both the target and the server's count per request.
"""

from __future__ import annotations

import json
import math
import random
from dataclasses import dataclass
from itertools import count
from pathlib import Path

from tokenload.errors import ConfigError
from tokenload.load.scenario import Distribution, Scenario
from tokenload.record import RequestRecord
from tokenload.tokens import estimate_tokens, synth_prompt

# Calibration ratio bounds: a ratio outside them means the server counts something
# else entirely (images, a huge system prompt), and scaling by it would mislead.
_RATIO_BOUNDS = (0.25, 4.0)


class Sampler:
    """Draws positive integers from a `Distribution`; a sweep cycles through its values."""

    def __init__(self, dist: Distribution, rng: random.Random) -> None:
        self.dist = dist
        self._rng = rng
        self._sweep = count()

    def draw(self) -> int:
        p, rng = self.dist.params, self._rng
        match self.dist.dist:
            case "fixed":
                return int(p["value"])
            case "sweep":
                values = p["values"]
                return int(values[next(self._sweep) % len(values)])
            case "uniform":
                return rng.randint(p["min"], p["max"])
            case "normal":
                value = rng.gauss(p["mean"], p["std"])
            case _:  # lognormal, parameterised by its median
                value = p["median"] * math.exp(rng.gauss(0.0, p["sigma"]))
        value = max(p["min"], round(value))
        return int(min(value, p["max"])) if "max" in p else int(value)


@dataclass(frozen=True, slots=True)
class RequestPlan:
    """One request to send."""

    model: str
    prompt: str
    prompt_tokens_target: int
    estimated_input_tokens: int
    max_tokens: int


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

    @property
    def ratio(self) -> float:
        if not self.local:
            return 1.0
        low, high = _RATIO_BOUNDS
        return min(high, max(low, self.server / self.local))


def read_dataset(path: str) -> list[str]:
    """Prompts from a JSONL file: one object per line with a `prompt` (or `text`) string."""
    prompts = []
    with Path(path).open(encoding="utf-8") as fh:
        for n, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ConfigError(f"dataset {path} line {n}: not valid JSON: {exc.msg}") from None
            text = obj.get("prompt", obj.get("text")) if isinstance(obj, dict) else None
            if not isinstance(text, str) or not text:
                raise ConfigError(f"dataset {path} line {n}: expected an object with a non-empty \"prompt\" string")
            prompts.append(text)
    if not prompts:
        raise ConfigError(f"dataset {path} holds no prompts")
    return prompts


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
        self._dataset = read_dataset(scenario.prompt.dataset) if scenario.prompt.dataset else None
        shared = scenario.prompt.shared_prefix_tokens
        self._prefix = synth_prompt(shared, seed=scenario.seed) if shared else ""
        self._calibrate = scenario.prompt.calibrate
        self.calibration = Calibration()

    def next(self) -> RequestPlan:
        n = next(self._n)
        model = self._models[0] if len(self._models) == 1 else self._rng.choice(self._models)
        if self._dataset is not None:
            text = self._dataset[n % len(self._dataset)]
            prompt = f"[{self._salt}-{n}] {text}" if not self._prefix else text
            target = estimate_tokens(prompt)
        else:
            assert self._tokens is not None
            target = self._tokens.draw()
            local = target
            if self._calibrate:
                local = max(estimate_tokens(self._prefix) + 1, round(target / self.calibration.ratio))
            prompt = synth_prompt(local, seed=(self._salt << 32) | n, prefix=self._prefix)
        return RequestPlan(model, prompt, target, estimate_tokens(prompt), self._max_tokens.draw())

    def observe(self, record: RequestRecord, plan: RequestPlan) -> None:
        """Learn from a finished request's server-reported input tokens."""
        tokens = record.get("input_tokens")
        if record.get("input_tokens_source") == "server" and tokens:
            self.calibration.observe(tokens, plan.estimated_input_tokens)
