"""A `[design]`: prompt length, output length and model varied independently, so each one's effect can be told apart.

Sweeps of `[prompt] tokens` and `[output] max_tokens` advance in lockstep (the
n-th request takes the n-th value of each), so a run cannot say which of the
two moved the latency. A design crosses their levels with the channel's models
instead: `factorial` takes every combination, `latin` a Latin hypercube of
`points` combinations in which each level of each factor comes equally often.
Each user sends the design's cells a block at a time, every block in the user's
own seeded random order, so every user, and every load step, sees a balanced
mix: load is crossed with the other factors by the `[load]` steps themselves.
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TypeVar

from tokenload.workload.scenario import DesignSection, Distribution


@dataclass(frozen=True, slots=True)
class Cell:
    """One combination of the design's factors."""

    prompt_tokens: int
    max_tokens: int
    model: str


def levels(dist: Distribution) -> list[int]:
    """A factor's levels: a sweep's values, or a fixed value alone (the scenario admits only these with a design)."""
    return list(dict.fromkeys(dist.params["values"])) if dist.dist == "sweep" else [int(dist.params["value"])]


T = TypeVar("T")


def latin_column(values: Sequence[T], points: int, rng: random.Random) -> list[T]:
    """A Latin hypercube's column: the levels repeated evenly to `points` entries, shuffled."""
    column = [values[i % len(values)] for i in range(points)]
    rng.shuffle(column)
    return column


class Design:
    """The design's cells for one process; `cursor(user)` hands a user its cells, block by block."""

    def __init__(self, spec: DesignSection, prompt: Distribution, output: Distribution, models: Sequence[str],
                 seed: int) -> None:
        self.spec = spec
        self.factors: tuple[list[int], list[int], list[str]] = (levels(prompt), levels(output), list(models))
        self.seed = seed

    @property
    def block_size(self) -> int:
        if self.spec.kind == "factorial":
            return len(self.factors[0]) * len(self.factors[1]) * len(self.factors[2])
        return self.spec.points or max(len(f) for f in self.factors)

    def block(self, rng: random.Random) -> list[Cell]:
        """One block of cells in random order."""
        prompts, outputs, models = self.factors
        if self.spec.kind == "factorial":
            cells = [Cell(p, n, m) for p, n, m in itertools.product(prompts, outputs, models)]
            rng.shuffle(cells)
            return cells
        size = self.block_size
        return [Cell(p, n, m) for p, n, m in zip(latin_column(prompts, size, rng), latin_column(outputs, size, rng),
                                                 latin_column(models, size, rng))]

    def cursor(self, user: str) -> DesignCursor:
        return DesignCursor(self, random.Random(f"{self.seed}:design:{user}"))


class DesignCursor:
    """One user's walk through the design: a fresh random block whenever the last one is used up."""

    def __init__(self, design: Design, rng: random.Random) -> None:
        self._design = design
        self._rng = rng
        self._left: list[Cell] = []

    def next(self) -> Cell:
        if not self._left:
            self._left = self._design.block(self._rng)
            self._left.reverse()
        return self._left.pop()
