"""Synthetic request records that follow a known law.

Tests and the scale benchmark need runs whose truth is known exactly: the
prefill law `ttft = queue(users) + a + b * n**k`, a TPOT that grows with batch
size, a capacity past which requests queue (the planted breakpoint) and error
bursts at chosen concurrencies. The output has every contract column, so the
analysis reads it exactly as it reads a real run.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import pandas as pd

from tokenload.analysis.records import write_run
from tokenload.protocolspec import DEFAULT_PROTOCOL, SPECS


@dataclass(frozen=True)
class Law:
    """The ground truth a synthetic run follows (all times in seconds)."""

    users: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64)
    prefill_a: float = 0.2
    prefill_b: float = 0.0003
    prefill_k: float = 1.0
    tpot_s: float = 0.02
    # Fractional TPOT increase per extra concurrent stream (batching), up to capacity.
    tpot_batch_growth: float = 0.0
    # Concurrent streams the server runs at once; beyond it requests wait in a queue.
    capacity: int = 16
    input_tokens: tuple[int, int] = (100, 2000)
    output_tokens: tuple[int, int] = (20, 100)
    # Multiplicative lognormal noise (sigma) on TTFT and TPOT, mean one.
    noise: float = 0.02
    # Error rate per concurrency, e.g. {32: 0.2}; errors come in a burst in the step's first third.
    error_rates: Mapping[int, float] = field(default_factory=dict)
    error_kind: str = "overloaded"
    model: str = "synthetic-model"

    def tpot_at(self, users: np.ndarray) -> np.ndarray:
        """Mean TPOT at a concurrency: grows with batch size until capacity."""
        return self.tpot_s * (1.0 + self.tpot_batch_growth * (np.minimum(users, self.capacity) - 1))

    def prefill(self, n: np.ndarray) -> np.ndarray:
        """Mean TTFT without queueing for an input of n tokens."""
        return self.prefill_a + self.prefill_b * np.power(n, self.prefill_k)


def _mean_one_noise(rng: np.random.Generator, sigma: float, size: int) -> np.ndarray:
    if sigma <= 0:
        return np.ones(size)
    return np.exp(rng.normal(-sigma * sigma / 2.0, sigma, size))


def generate(law: Law = Law(), n: int = 20_000, seed: int = 0, start: float = 1_700_000_000.0) -> pd.DataFrame:
    """Return about `n` records of a closed-loop ramp over `law.users`.

    Requests per step follow closed-loop throughput (users / mean latency), so
    throughput flattens exactly at capacity: the knee is where queueing starts.
    """
    rng = np.random.default_rng(seed)
    users = np.asarray(law.users, dtype=np.int64)
    mean_in = float(np.mean(law.input_tokens))
    mean_out = float(np.mean(law.output_tokens))
    service = law.prefill(np.array([mean_in]))[0] + law.tpot_at(users) * (mean_out - 1)
    queue_wait = np.maximum(0.0, users / law.capacity - 1.0) * service
    rate = users / (service + queue_wait)
    counts = np.maximum(1, np.round(n * rate / rate.sum())).astype(np.int64)
    step_s = float(counts.sum() / rate.sum())

    step_idx = np.repeat(np.arange(len(users)), counts)
    size = len(step_idx)
    u = users[step_idx]
    n_in = rng.integers(law.input_tokens[0], law.input_tokens[1] + 1, size).astype(np.float64)
    n_out = rng.integers(law.output_tokens[0], law.output_tokens[1] + 1, size).astype(np.float64)
    queue = queue_wait[step_idx] * rng.exponential(1.0, size)
    ttft = queue + law.prefill(n_in) * _mean_one_noise(rng, law.noise, size)
    tpot = law.tpot_at(u) * _mean_one_noise(rng, law.noise, size)
    e2e = ttft + tpot * (n_out - 1)
    offset = rng.uniform(0.0, step_s, size)
    started = start + step_idx * step_s + offset

    error_rate = np.array([law.error_rates.get(int(x), 0.0) for x in users])[step_idx]
    in_burst = offset < step_s / 3.0
    is_error = rng.uniform(0.0, 1.0, size) < np.where(in_burst, 3.0 * error_rate, 0.0)

    df = pd.DataFrame({
        "request_id": pd.RangeIndex(size).astype(str),
        "run_id": "synthetic",
        "worker": "w0",
        "user_id": rng.integers(0, u),
        "step": step_idx + 1,
        "active_users": u,
        "scheduled_at": started - rng.exponential(0.001, size),
        "started_at": started,
        "protocol": DEFAULT_PROTOCOL,
        "model": law.model,
        "status": np.where(is_error, "error", "ok"),
        "error_kind": pd.Series(np.where(is_error, law.error_kind, np.array(None)), dtype="string"),
        "http_status": np.where(is_error, 529, 200),
        "ttfb_s": ttft * 0.5,
        "ttft_s": np.where(is_error, np.nan, ttft),
        "ttft_text_s": np.where(is_error, np.nan, ttft),
        "tpot_s": np.where(is_error, np.nan, tpot),
        "e2e_s": np.where(is_error, np.nan, e2e),
        "input_tokens": n_in.astype(np.int64),
        "input_tokens_source": "usage",
        "output_tokens": np.where(is_error, 0, n_out).astype(np.int64),
        "output_tokens_source": "usage",
        "max_tokens": int(law.output_tokens[1]),
        "chunks": np.where(is_error, 0, n_out).astype(np.int64),
        "itl_p50_s": tpot,
        "itl_p99_s": tpot * 2.0,
        "itl_max_s": tpot * 3.0,
        "stop_reason": np.where(is_error, np.array(None), "end_turn"),
        "finished_at": started + np.where(is_error, 0.0, e2e),
        "in_flight": np.zeros(size, dtype=bool),
    })
    return df


def manifest_for(law: Law, df: pd.DataFrame) -> dict:
    """A manifest shaped like the load generator's, with the law recorded as the scenario."""
    law_dict = asdict(law)
    law_dict["error_rates"] = {str(k): v for k, v in law.error_rates.items()}
    return {
        "run_id": "synthetic",
        "started_at": float(df["started_at"].min()) if len(df) else None,
        "ended_at": float(df["finished_at"].max()) if len(df) else None,
        "scenario": {"name": "synthetic", "law": law_dict},
        "channel": {"base_url": "synthetic://", "protocol": DEFAULT_PROTOCOL, "model": law.model},
        "versions": {"tokenload": "synthetic"},
        "scheduler_lag": {},
    }


def write_synthetic_run(run_dir: str | Path, law: Law = Law(), n: int = 20_000, seed: int = 0) -> Path:
    """Generate a run and write it as RUN_DIR (requests.parquet + manifest.json)."""
    df = generate(law, n=n, seed=seed)
    return write_run(run_dir, df, manifest_for(law, df))


@dataclass(frozen=True)
class DesignLaw:
    """A run of a `[design]` (or of lockstep sweeps) whose every factor's effect is known.

    TTFT = scale x (a + b n^k) x (1 + load_growth x (users - 1)) and TPOT = scale x tpot_s x (1 + load_growth x
    (users - 1)), with scale = (size / 7)^size_exponent per model, times mean-one lognormal noise.
    """

    models: Mapping[str, float] = field(default_factory=lambda: {"syn-7b": 7.0, "syn-30b": 30.0})
    size_exponent: float = 0.63
    prompts: tuple[int, ...] = (64, 256, 1024, 4096)
    outputs: tuple[int, ...] = (8, 32, 128)
    users: tuple[int, ...] = (1, 4)
    prefill_a: float = 0.05
    prefill_b: float = 0.0004
    prefill_k: float = 0.85
    tpot_s: float = 0.02
    load_growth: float = 0.1
    noise: float = 0.03
    # True: prompt and output lengths advance together (zip, as two sweeps do), not crossed.
    lockstep: bool = False

    def scale(self, model: str) -> float:
        return float((self.models[model] / 7.0) ** self.size_exponent)

    def ttft(self, model: str, n: float, users: float) -> float:
        return self.scale(model) * (self.prefill_a + self.prefill_b * n ** self.prefill_k) * self.load(users)

    def tpot(self, model: str, users: float) -> float:
        return self.scale(model) * self.tpot_s * self.load(users)

    def load(self, users: float) -> float:
        return 1.0 + self.load_growth * (users - 1)


def generate_design(law: DesignLaw = DesignLaw(), per_cell: int = 6, seed: int = 0,
                    start: float = 1_700_000_000.0) -> pd.DataFrame:
    """`per_cell` finished requests of every (prompt, output, model) cell at every user level, one step per level."""
    rng = np.random.default_rng(seed)
    pairs = list(zip(law.prompts, law.outputs)) if law.lockstep else [(p, o) for p in law.prompts for o in law.outputs]
    cells = [(p, o, m, u) for u in law.users for m in law.models for p, o in pairs for _ in range(per_cell)]
    p, o, m, u = (np.array(col) for col in zip(*cells))
    size = len(cells)
    ttft = np.array([law.ttft(mm, pp, uu) for pp, mm, uu in zip(p, m, u)]) * _mean_one_noise(rng, law.noise, size)
    tpot = np.array([law.tpot(mm, uu) for mm, uu in zip(m, u)]) * _mean_one_noise(rng, law.noise, size)
    e2e = ttft + tpot * (o - 1)
    step = np.searchsorted(np.array(law.users), u) + 1
    started = start + step * 1000.0 + rng.uniform(0, 900, size)
    return pd.DataFrame({
        "request_id": pd.RangeIndex(size).astype(str), "run_id": "synthetic-design", "worker": "w0",
        "user_id": rng.integers(0, u).astype(str), "step": step, "active_users": u, "scheduled_at": started,
        "started_at": started, "protocol": DEFAULT_PROTOCOL, "model": m, "status": "ok",
        "error_kind": pd.Series([None] * size, dtype="string"), "http_status": 200, "ttfb_s": ttft, "ttft_s": ttft,
        "ttft_text_s": ttft, "tpot_s": tpot, "e2e_s": e2e, "input_tokens": p.astype(np.int64),
        "input_tokens_source": "server", "output_tokens": o.astype(np.int64), "output_tokens_source": "server",
        "max_tokens": o.astype(np.int64), "prompt_tokens_target": p.astype(np.int64), "chunks": o.astype(np.int64),
        "itl_p50_s": tpot, "itl_p99_s": tpot * 1.5, "itl_max_s": tpot * 2.0, "stop_reason": SPECS[DEFAULT_PROTOCOL].length_stop,
        "finished_at": started + e2e, "in_flight": np.zeros(size, dtype=bool),
    })


def write_design_run(run_dir: str | Path, law: DesignLaw = DesignLaw(), per_cell: int = 6, seed: int = 0,
                     slo: Mapping[str, float] | None = None) -> Path:
    """A design run as RUN_DIR, its scenario naming the models (the first the channel's) and the SLO."""
    df = generate_design(law, per_cell, seed)
    manifest = {"run_id": "synthetic-design", "started_at": float(df["started_at"].min()),
                "ended_at": float(df["finished_at"].max()),
                "scenario": {"name": "synthetic-design", "channel": {"models": list(law.models)},
                             "load": {"kind": "steps", "users": list(law.users)},
                             **({"slo": dict(slo)} if slo else {})},
                "channel": {"base_url": "synthetic://", "protocol": DEFAULT_PROTOCOL, "model": next(iter(law.models))},
                "versions": {"tokenload": "synthetic"}, "scheduler_lag": {}}
    return write_run(run_dir, df, manifest)
