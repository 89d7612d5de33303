"""Offline token estimates and synthetic prompts; no tokenizer download, ever.

The estimate counts word runs and single punctuation marks. It is what the
simulator reports as usage, so against the simulator estimates are exact; on a
real channel the load generator calibrates from the server's reported counts.
Synthetic prompts are made of common words that every BPE tokenizer keeps whole,
so one word is about one token everywhere.
"""

from __future__ import annotations

import random
import re

_TOKEN_RE = re.compile(r"\w+|[^\w\s]")

_WORDS = (
    "the of and to in is was for on that with as by at from his her they this have "
    "are not but had one all were when we there can an which their said if do will "
    "each about how up out them then she many some so these would other into has more "
    "two like him see time could no make than first been its who now people my made "
    "over did down only way find use may water long little very after words called "
    "just where most know get through back much before go good new write our used me "
    "man too any day same right look think also around another came come work three "
    "word must because does part even place well such here take why things help put "
    "years different away again off went old number great tell men say small every "
    "found still between name should home big give air line set own under read last "
    "never us left end along while might next sound below saw something thought both "
    "few those always looked show large often together asked house world going want "
    "school important until form food keep children feet land side without boy once "
    "animals life enough took sometimes four head above kind began almost live page"
).split()


def estimate_tokens(text: str) -> int:
    """Deterministic local estimate of the token count of `text`."""
    return len(_TOKEN_RE.findall(text))


def tokens_of(text: str) -> list[str]:
    """The tokens `estimate_tokens` counts, in order (the simulator's prompt cache hashes them)."""
    return _TOKEN_RE.findall(text)


def synth_prompt(n_tokens: int, seed: int = 0, prefix: str = "") -> str:
    """A prompt of exactly `n_tokens` estimated tokens (including `prefix`).

    `seed` makes each request's text unique so channels cannot serve it from a
    prompt cache; the same seed always gives the same text.
    """
    if n_tokens < 0:
        raise ValueError("n_tokens must be >= 0")
    have = estimate_tokens(prefix)
    rng = random.Random(seed)
    words = [prefix] if prefix else []
    words.extend(rng.choice(_WORDS) for _ in range(max(0, n_tokens - have)))
    return " ".join(words)
