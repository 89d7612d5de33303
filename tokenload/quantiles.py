"""Percentiles of a column too long to hold in memory: exact order statistics in a few passes over its chunks.

Up to `HOLD` finite values are gathered and handed to `numpy.percentile`, so an
ordinary run reads exactly as before. More are never held: each further pass
reads the chunks once and counts the values in 65,536 buckets by the next 16
bits of an order-preserving integer key, narrowing every wanted rank to one
bucket; a bucket of at most `HOLD` values is then gathered and partitioned. The
result is numpy's linear interpolation (Hyndman and Fan's type 7) between the
same two order statistics. `KaplanMeier`: a censored sample's curve walked a block at a time (the analysis'
percentiles of a step of millions of records).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence

import numpy as np

HOLD = 1_000_000  # values gathered at once (8 MB)
_BITS = 16  # bits of the key narrowed per pass
_SIGN = np.uint64(1 << 63)

Chunks = Callable[[], Iterable[np.ndarray]]  # called once per pass: the column's values, chunk by chunk


def _finite(chunk: np.ndarray) -> np.ndarray:
    values = np.asarray(chunk, dtype=np.float64)
    return values[np.isfinite(values)]


def _keys(values: np.ndarray) -> np.ndarray:
    """An unsigned key per float64 that sorts as the floats do."""
    bits = values.view(np.uint64)
    return np.where(bits & _SIGN, ~bits, bits | _SIGN)


def _value(key: int) -> float:
    """The float64 whose key is `key`."""
    bits = np.uint64(key & ~(1 << 63) if key >> 63 else ~key & ((1 << 64) - 1))
    return float(bits.view(np.float64))


def _top(keys: np.ndarray, bits: int) -> np.ndarray:
    return keys >> np.uint64(64 - bits)


def order_statistics(chunks: Chunks, ranks: Sequence[int], hold: int = HOLD) -> list[float]:
    """The values at the 0-based `ranks` among the finite values `chunks` yields, holding at most `hold` at once."""
    # Per rank: (the top `fixed` bits of its key, fixed, its rank among the values with that prefix, how many
    # values have it: -1 before the first pass).
    state = {rank: (0, 0, rank, -1) for rank in set(ranks)}
    out: dict[int, float] = {}
    while state:
        counting = {(p, f) for p, f, _, size in state.values() if not 0 <= size <= hold}
        gathering = {(p, f) for p, f, _, size in state.values() if 0 <= size <= hold}
        counts = {g: np.zeros(1 << _BITS, dtype=np.int64) for g in counting}
        gathered: dict[tuple[int, int], list[np.ndarray]] = {g: [] for g in gathering}
        for chunk in chunks():
            values = _finite(chunk)
            keys = _keys(values)
            for prefix, fixed in counting:
                inside = keys[_top(keys, fixed) == np.uint64(prefix)] if fixed else keys
                low = (inside >> np.uint64(64 - fixed - _BITS)) & np.uint64((1 << _BITS) - 1)
                counts[prefix, fixed] += np.bincount(low.astype(np.intp), minlength=1 << _BITS)
            for prefix, fixed in gathering:
                gathered[prefix, fixed].append(values[_top(keys, fixed) == np.uint64(prefix)])
        following = {}
        for rank, (prefix, fixed, left, _) in state.items():
            if (prefix, fixed) in gathering:
                values = np.concatenate(gathered[prefix, fixed])
                out[rank] = float(np.partition(values, left)[left])
                continue
            cumulative = np.cumsum(counts[prefix, fixed])
            bucket = int(np.searchsorted(cumulative, left, side="right"))
            left -= int(cumulative[bucket - 1]) if bucket else 0
            prefix, fixed = prefix << _BITS | bucket, fixed + _BITS
            if fixed == 64:  # every candidate has this key: one value
                out[rank] = _value(prefix)
            else:
                following[rank] = (prefix, fixed, left, int(counts[prefix >> _BITS, fixed - _BITS][bucket]))
        state = following
    return [out[r] for r in ranks]


def percentiles(chunks: Chunks, percents: Sequence[float], hold: int = HOLD) -> tuple[int, list[float]]:
    """(how many finite values, numpy's linear percentiles of them: NaN when there are none), in bounded memory."""
    n, held = 0, []
    for chunk in chunks():
        values = _finite(chunk)
        n += len(values)
        if n <= hold:
            held.append(values)
    if n <= hold:
        values = np.concatenate(held) if held else np.empty(0)
        return n, [float(v) for v in np.percentile(values, percents)] if n else [float("nan")] * len(percents)
    virtual = [(n - 1) * (p / 100) for p in percents]  # numpy's virtual index, linear method
    below = [min(int(np.floor(v)), n - 1) for v in virtual]
    ranks = [*below, *(min(b + 1, n - 1) for b in below)]
    found = dict(zip(ranks, order_statistics(chunks, ranks, hold)))
    out = []
    for v, b in zip(virtual, below):
        lo, hi, gamma = found[b], found[min(b + 1, n - 1)], v - b
        out.append(float(hi - (hi - lo) * (1 - gamma) if gamma >= 0.5 else lo + (hi - lo) * gamma))
    return n, out


class KaplanMeier:
    """The Kaplan-Meier curve of censored times walked a block of events at a time: the product of (1 - 1 / at
    risk) in the order of one `cumprod` over every observation, events before censorings at a time (bit for bit)."""

    BLOCK = 1 << 20

    def __init__(self, t: np.ndarray, e: np.ndarray) -> None:
        self.events = t[e]
        self.events.sort()
        self.censored = t[~e]
        self.censored.sort()
        self.n = t.size
        self.largest = float(max(self.events[-1], self.censored[-1] if self.censored.size else -np.inf))

    def blocks(self) -> Iterator[tuple[np.ndarray, np.ndarray, np.ndarray]]:
        """(event times, CDF after each, Greenwood's sum 1 / (n_i (n_i - 1)) up to each), block by block."""
        carry, greenwood = 1.0, 0.0
        for start in range(0, self.events.size, self.BLOCK):
            block = self.events[start:start + self.BLOCK]
            at_risk = self.n - (np.arange(start, start + block.size) + np.searchsorted(self.censored, block, "left"))
            survival = np.cumprod(np.concatenate(([carry], 1.0 - 1.0 / at_risk)))[1:]
            with np.errstate(divide="ignore"):
                terms = np.cumsum(np.concatenate(([greenwood], 1.0 / (at_risk * (at_risk - 1.0)))))[1:]
            yield block, 1.0 - survival, terms
            carry, greenwood = float(survival[-1]), float(terms[-1])

    def first(self, level: float) -> float | None:
        """The first event time at which the CDF reaches `level` (None: it never does)."""
        for block, cdf, _ in self.blocks():
            hit = np.flatnonzero(cdf >= level)
            if hit.size:
                return float(block[hit[0]])
        return None

    def at(self, level: float) -> tuple[float, float] | None:
        """(survival, Greenwood's sum) where the CDF first reaches `level` (None: it never does)."""
        for _, cdf, terms in self.blocks():
            hit = np.flatnonzero(cdf >= level)
            if hit.size:
                return 1.0 - float(cdf[hit[0]]), float(terms[hit[0]])
        return None
