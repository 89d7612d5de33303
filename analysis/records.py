"""Load and validate a run directory (the contract's RUN_DIR layout).

Everything downstream assumes a clean frame: numeric timing columns as float,
`status` as `ok`/`error`, in-flight streams flagged. This module is the one
place that knows the on-disk contract, so a broken run dir fails here with one
`ConfigError` line that names the problem instead of a traceback later.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, cast

import numpy as np
import pandas as pd

from tokenload.contracts.manifest import Manifest
from tokenload.errors import ConfigError
from tokenload.record import COLUMNS, SPEC_COLUMNS, STORM_PROBE
from tokenload.rundir import MANIFEST_FILE, REQUESTS_FILE

# The contract's "at least" columns (defined in tokenload.record). All must exist (a missing one is
# named in the error), but analysis reads only ANALYSIS_COLUMNS to keep memory low on million-row runs.
REQUIRED_COLUMNS: tuple[str, ...] = SPEC_COLUMNS
FLOAT_COLUMNS: tuple[str, ...] = (
    "scheduled_at", "started_at", "ttft_s", "tpot_s", "e2e_s", "input_tokens",
    "output_tokens", "itl_p50_s", "itl_p99_s", "itl_max_s",
)
CATEGORY_COLUMNS: tuple[str, ...] = ("status", "error_kind", "model")
ANALYSIS_COLUMNS: tuple[str, ...] = (
    "step", "active_users", *FLOAT_COLUMNS, *CATEGORY_COLUMNS,
)
# Record columns the analysis' frame leaves out, to keep memory low on million-row runs: identifiers, words,
# and the columns a module reads from requests.parquet itself when it needs them. Every other column of
# `tokenload.record.RequestRecord` is carried through as the run has it (`CARRIED_COLUMNS`), so a new column
# reaches the analysis unless it is named here.
LEFT_OUT: dict[str, str] = {
    "request_id": "an identifier", "run_id": "the manifest's", "worker": "an identifier", "user_id": "an identifier",
    "protocol": "the manifest's channel", "server_request_id": "an identifier",
    "http_status": "read by analysis.outage from the file", "error_message": "read by analysis.outage from the file",
    "ttft_text_s": "not analysed", "input_tokens_source": "not analysed", "stop_reason": "words",
    "late_s": "the manifest's open_loop_lateness", "duration_s": "not analysed", "reasoning_tokens": "not analysed",
    "thinking_chunks": "not analysed", "malformed_events": "not analysed", "eos_only": "not analysed",
    **{name: "read by analysis.ratelimits from the file" for name in (
        "backoff_s", "held_s", "retry_of", "retry_after_s", "rl_requests_limit", "rl_requests_remaining",
        "rl_tokens_limit", "rl_tokens_remaining")},
}
CARRIED_COLUMNS: tuple[str, ...] = tuple(c for c in COLUMNS if c not in ANALYSIS_COLUMNS and c not in LEFT_OUT)
# Rows of the run-level warm-up (`phase == "warmup"`, scenario `[load] warmup_requests` / `warmup_s`) and the
# error-storm breaker's probes (`storm_probe`, sent while the users were paused) are set apart here (`Run.aside`),
# so no statistic ever includes them.
WARMUP_PHASE = "warmup"
# A run of more records is not loaded whole (about 830 MB of analysis a million records): its frame is a seeded
# uniform sample of SAMPLE_ROWS, and `outofcore` counts the rest from requests.parquet a chunk at a time.
ANALYSIS_ROWS = 1_000_000
SAMPLE_ROWS = 500_000  # half the frame's memory; any percentile of it within 0.23 points of the run's (outofcore)
CHUNK_ROWS = 131_072  # records read at once from requests.parquet when it is not loaded whole
SAMPLE_SEED = 0


@dataclass(frozen=True)
class Sample:
    """A run too long to load: its frame holds `kept` of its `rows` records, chosen uniformly (seeded)."""

    rows: int
    kept: int
    seed: int
    parquet: Path
    columns: tuple[str, ...]  # the columns the frame was read with
    last_finished: float  # over every measured record (the frame's would be the sample's)
    last_sent: float
    model: str | None = None  # only this model's records count (a comparison of a run's models)


@dataclass
class Run:
    """One loaded run: the cleaned request frame plus what the manifest says."""

    run_dir: Path
    manifest: Manifest  # as the run wrote it; a run of an older version may lack keys
    df: pd.DataFrame
    problems: list[str] = field(default_factory=list)
    # The rows set apart (warm-up and storm probes, by `phase`), with the columns of `df`: in no statistic, but
    # the channel served them, and what they cost is part of a search's spend.
    aside: pd.DataFrame = field(default_factory=pd.DataFrame)
    # Set when `df` is a sample of a run too long to load (ANALYSIS_ROWS): `outofcore` counts the whole run.
    sample: Sample | None = None

    @property
    def started_at(self) -> float | None:
        """Run start in unix seconds: manifest first, else the first request."""
        value = _unix(self.manifest.get("started_at"))
        if value is None and len(self.df):
            value = float(self.df["started_at"].min())
        return value

    @property
    def ended_at(self) -> float | None:
        """Run end in unix seconds: manifest first, else the last request to finish."""
        value = _unix(self.manifest.get("ended_at"))
        if value is None and len(self.df):
            value = float(self.df["finished_at"].max())
        return value

    @property
    def cut(self) -> float:
        """When the run stopped: a stream cut open with no `cut_at` of its own (an older run) was cut here."""
        if self.sample is not None:
            last_seen = self.sample.last_finished
        else:
            last_seen = float(np.nanmax(self.df["finished_at"].to_numpy())) if len(self.df) else 0.0
        end = self.ended_at
        return last_seen if end is None else max(end, last_seen)

    @property
    def label(self) -> str:
        """Default label for comparisons: the run's local start time."""
        start = self.started_at
        if start is None:
            return self.run_dir.name
        return datetime.fromtimestamp(start).strftime("%Y-%m-%d %H:%M")

    @property
    def ok(self) -> pd.DataFrame:
        """Successful, completed requests: the only ones fits and percentiles use."""
        return self.df[self.df["status"].eq("ok") & ~self.df["in_flight"]]


def cut_text(cut: int, step_down: int) -> str:
    """'3 cut at a step down, 2 still open at the end': the streams tokenload cut open, and when."""
    if not step_down:
        return f"{cut:,} still open at the end"
    return f"{step_down:,} cut at a step down" + (f", {cut - step_down:,} still open at the end" if cut > step_down
                                                  else "")


def _unix(value: Any) -> float | None:
    """Accept unix seconds or an ISO-8601 string (naive means UTC)."""
    if value is None:
        return None
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value) if math.isfinite(value) else None
    if isinstance(value, str):
        try:
            parsed = datetime.fromisoformat(value.replace("Z", "+00:00"))
        except ValueError:
            return None
        if parsed.tzinfo is None:
            parsed = parsed.replace(tzinfo=timezone.utc)
        return parsed.timestamp()
    return None


def _read_manifest(run_dir: Path, problems: list[str]) -> Manifest:
    path = run_dir / MANIFEST_FILE
    if not path.exists():
        problems.append(f"{MANIFEST_FILE} is missing: run metadata (scenario, channel) unknown")
        return cast(Manifest, {})
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        problems.append(f"{MANIFEST_FILE} is unreadable ({exc}): run metadata unknown")
        return cast(Manifest, {})
    if not isinstance(data, dict):
        problems.append(f"{MANIFEST_FILE} is not a JSON object: run metadata unknown")
        return cast(Manifest, {})
    return cast(Manifest, data)


def load_run(run_dir: str | Path, max_rows: int | None = None) -> Run:
    """Read RUN_DIR into a `Run`; raise `ConfigError` for anything that is not a run.

    Missing optional columns are derived (`finished_at` from start + e2e,
    `in_flight` as False, a cut stream's `cut_at` as the run's end) so the rest
    of the analysis needs no special cases. A run of more than `max_rows`
    (ANALYSIS_ROWS) records is loaded as a sample of at most SAMPLE_ROWS (`Run.sample`).
    """
    import pyarrow.parquet as pq

    path = Path(run_dir)
    if not path.is_dir():
        raise ConfigError(f"{path} is not a directory: pass the run directory that `tokenload run` printed")
    parquet = path / REQUESTS_FILE
    if not parquet.exists():
        raise ConfigError(f"{path} is not a run directory: {REQUESTS_FILE} is missing")
    try:
        schema_names = set(pq.read_schema(parquet).names)
    except Exception as exc:  # pyarrow raises several unrelated types for a bad file
        raise ConfigError(f"{parquet} is not a readable parquet file: {exc}") from exc
    missing = [c for c in REQUIRED_COLUMNS if c not in schema_names]
    if missing:
        raise ConfigError(f"{parquet} lacks required column(s): {', '.join(missing)}")
    wanted = [*ANALYSIS_COLUMNS, *(c for c in CARRIED_COLUMNS if c in schema_names)]
    limit = ANALYSIS_ROWS if max_rows is None else max_rows
    problems: list[str] = []
    manifest = _read_manifest(path, problems)
    try:
        total = pq.ParquetFile(parquet).metadata.num_rows
        if total > limit:
            sample = _sample(parquet, tuple(wanted), total, min(limit, SAMPLE_ROWS))
            df = _read_sample(sample)
        else:
            sample = None
            df = pq.read_table(parquet, columns=wanted).to_pandas()
    except Exception as exc:
        raise ConfigError(f"{parquet} could not be read: {exc}") from exc
    measured, aside = _set_apart(df, _normalise(df))
    run = Run(run_dir=path, manifest=manifest, df=measured, problems=problems, aside=aside, sample=sample)
    last_sent = sample.last_sent if sample else float(pd.to_numeric(df["started_at"], errors="coerce").max()) \
        if len(df) else 0.0
    when_cut(run.df, run.cut, last_sent)
    return run


def chunks(parquet: Path, columns: Sequence[str]) -> Iterator[pd.DataFrame]:
    """requests.parquet's records, CHUNK_ROWS at a time, as the raw frame `load_run` normalises."""

    for batch in _batches(parquet, columns):
        yield batch.to_pandas()


def _batches(parquet: Path, columns: Sequence[str]) -> Iterator[Any]:
    """CHUNK_ROWS records at a time, read one after the other: pyarrow's defaults (its reads ahead, pre-buffered)
    held 300 MB of a 10M run's four columns in the allocator."""
    import pyarrow.parquet as pq

    yield from pq.ParquetFile(parquet, pre_buffer=False).iter_batches(batch_size=CHUNK_ROWS, columns=list(columns),
                                                                      use_threads=False)


def normalised(raw: pd.DataFrame, cut: float, last_sent: float) -> tuple[pd.DataFrame, pd.DataFrame]:
    """A chunk of raw records as `load_run` makes them: (the measured ones, those set apart)."""
    measured, aside = _set_apart(raw, _normalise(raw))
    when_cut(measured, cut, last_sent)
    return measured, aside


def _sample(parquet: Path, columns: tuple[str, ...], total: int, keep: int) -> Sample:
    """A run too long to load: which records stand for it, and its extent over all of them."""
    last_finished, last_sent = -np.inf, -np.inf
    for raw in chunks(parquet, ("started_at", "e2e_s", *(c for c in ("finished_at", "phase") if c in columns))):
        measured, _ = _set_apart(raw, _finished(raw))
        last_sent = max(last_sent, float(pd.to_numeric(raw["started_at"], errors="coerce").max()))
        if len(measured):
            last_finished = max(last_finished, float(np.nanmax(measured["finished_at"].to_numpy())))
    return Sample(rows=total, kept=keep, seed=SAMPLE_SEED, parquet=parquet, columns=columns,
                  last_finished=last_finished, last_sent=last_sent)


def _read_sample(sample: Sample) -> pd.DataFrame:
    """The sample's records, in the file's order: `kept` of `rows` chosen uniformly without replacement (taken
    from each batch as Arrow, made a frame once: the frame is held once, not per chunk and again joined)."""
    import pyarrow as pa

    chosen = np.sort(np.random.default_rng(sample.seed).choice(sample.rows, sample.kept, replace=False))
    parts, offset = [], 0
    for batch in _batches(sample.parquet, sample.columns):
        lo, hi = np.searchsorted(chosen, [offset, offset + batch.num_rows])
        parts.append(batch.take(pa.array(chosen[lo:hi] - offset)))
        offset += batch.num_rows
    df = pa.Table.from_batches(parts, schema=parts[0].schema).to_pandas()
    del parts
    pa.default_memory_pool().release_unused()  # the decoded batches: the allocator keeps them otherwise
    return df


def when_cut(df: pd.DataFrame, cut: float, last_sent: float) -> None:
    """Each cut stream's `cut_at` (an older run's records lack it: the run's end, `cut`), and `cut_before_end`: it
    was cut while the run went on (a step down stopped its user: requests, warm-up ones included, were sent after
    it), not at the end."""
    open_ = df["in_flight"].to_numpy()
    if open_.any():
        df["cut_at"] = df["cut_at"].where(df["cut_at"].notna() | ~df["in_flight"], cut)
    df["cut_before_end"] = open_ & (df["cut_at"].to_numpy() < last_sent)


def _set_apart(raw: pd.DataFrame, out: pd.DataFrame) -> tuple[pd.DataFrame, pd.DataFrame]:
    """`out` plus the other carried columns of `raw` (those `_normalise` did not make): (the measured rows, the
    warm-up and storm-probe rows)."""
    for col in CARRIED_COLUMNS:
        if col in raw and col not in out:
            out[col] = raw[col].to_numpy()
    if "phase" not in out:
        return out, out.iloc[:0]
    aside = out["phase"].isin((WARMUP_PHASE, STORM_PROBE)).to_numpy()
    return out[~aside].reset_index(drop=True), out[aside].reset_index(drop=True)


def _normalise(df: pd.DataFrame) -> pd.DataFrame:
    """Coerce dtypes once so every later step can use plain vectorised numpy."""
    out = pd.DataFrame(index=pd.RangeIndex(len(df)))
    out["step"] = pd.to_numeric(df["step"], errors="coerce").fillna(0).astype(np.int64)
    out["active_users"] = pd.to_numeric(df["active_users"], errors="coerce").fillna(0).astype(np.int64)
    for col in FLOAT_COLUMNS:
        out[col] = pd.to_numeric(df[col], errors="coerce").astype(np.float64)
    status = df["status"].astype("string").str.lower().fillna("error")
    # `cancelled` (the run ended while the request was open, `in_flight`) is no error; `in_flight` keeps it
    # out of the completed requests.
    out["status"] = pd.Categorical(np.where(status.isin(["ok", "cancelled"]), "ok", "error"), categories=["ok", "error"])
    is_error = out["status"].eq("error").to_numpy()
    kind = df["error_kind"].astype("string").fillna("unknown")
    out["error_kind"] = pd.Categorical(kind.where(is_error, None))
    out["model"] = df["model"].astype("string").fillna("?").astype("category")
    out["finished_at"] = _finished(df)["finished_at"]
    if "in_flight" in df:
        out["in_flight"] = df["in_flight"].fillna(False).astype(bool).to_numpy()
    else:
        out["in_flight"] = False
    cut_at = pd.to_numeric(df["cut_at"], errors="coerce") if "cut_at" in df else pd.Series(np.nan, index=df.index)
    out["cut_at"] = cut_at.astype(np.float64).where(out["in_flight"].to_numpy()).to_numpy()
    if "prompt_tokens_target" in df:  # the prompt length asked: a sweep's or a design's level
        out["prompt_tokens_target"] = pd.to_numeric(df["prompt_tokens_target"], errors="coerce")
    return out


def _finished(df: pd.DataFrame) -> pd.DataFrame:
    """`finished_at` (a run without it: start + e2e), beside `phase` where the records have it."""
    started = pd.to_numeric(df["started_at"], errors="coerce").astype(np.float64)
    e2e = pd.to_numeric(df["e2e_s"], errors="coerce").astype(np.float64)
    out = pd.DataFrame(index=df.index)
    if "finished_at" in df:
        finished = pd.to_numeric(df["finished_at"], errors="coerce").astype(np.float64)
        out["finished_at"] = finished.fillna(started + e2e.fillna(0.0))
    else:
        out["finished_at"] = started + e2e.fillna(0.0)
    return out


def write_run(run_dir: str | Path, df: pd.DataFrame, manifest: dict[str, Any]) -> Path:
    """Write a run dir in the on-disk contract (used by the synthetic generator and tests)."""
    path = Path(run_dir)
    path.mkdir(parents=True, exist_ok=True)
    df.to_parquet(path / REQUESTS_FILE, index=False)
    (path / MANIFEST_FILE).write_text(json.dumps(manifest, indent=2), encoding="utf-8")
    return path
