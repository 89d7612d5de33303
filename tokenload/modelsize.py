"""A model's size in billions of parameters, read from its id or declared.

Model ids carry their size by convention: `llama-3.1-70b`, `qwen2.5-7b-instruct`,
`gemma-3-270m` (0.27), `mixtral-8x7b` (8 experts of 7B: 56, the nominal total).
A size inside a word (`A3B` of `Qwen3-30B-A3B`, the active share) is not read.
Ids that carry none (`claude-sonnet-4-20250514`) have no size unless the
scenario declares it (`[channel] model_sizes = { "my-model" = 30 }`).
"""

from __future__ import annotations

import re
from collections.abc import Mapping

# NxMb (a mixture of N experts of M billions), Nb (billions) or Nm (millions), as a whole token of the id.
_SIZE = re.compile(r"(?<![a-z0-9.])(?:(\d+)x)?(\d+(?:\.\d+)?)([bm])(?![a-z0-9])", re.IGNORECASE)


def size_from_id(model: str) -> float | None:
    """Billions of parameters the id names (`sim-30b` -> 30, `270m` -> 0.27, `8x7b` -> 56), else None."""
    match = _SIZE.search(model)
    if match is None:
        return None
    experts, value, unit = match.groups()
    size = float(value) * (int(experts) if experts else 1)
    return size / 1000 if unit.lower() == "m" else size


def model_size(model: str, declared: Mapping[str, float] | None = None) -> float | None:
    """The declared size of `model` (billions), else the one its id names, else None."""
    if declared and model in declared:
        return float(declared[model])
    return size_from_id(model)
