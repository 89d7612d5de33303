"""Drawing positive integers from a scenario `Distribution` (prompt and output lengths, turns)."""

from __future__ import annotations

import math
import random
from itertools import count

from tokenload.workload.scenario import Distribution


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
