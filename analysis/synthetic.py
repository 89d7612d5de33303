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
from tokenload.protocolspec import DEFAULT_PROTOCOL


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
