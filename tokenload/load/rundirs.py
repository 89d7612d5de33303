"""A run directory's life: its id and start info, then finalising it into requests.parquet + manifest.json.

Finalising happens after every Locust process has exited (or, for a master
with remote workers, after their last flush), never in a Locust `test_stop`:
the segments are merged into `requests.parquet` and `manifest.json` is written
(scenario as resolved, channel without secrets, versions, host, start/end,
steps, stop reason, scheduler lag, open-loop lateness, record counts per
worker), and the server's samples, if a sampler wrote any, into
server_metrics.parquet. `tokenload run`, the web UI's run series and plain `locust -f` all
finalise through `finalise`; `analyze` recovers a killed run with `recover`.
"""

from __future__ import annotations

import json
import os
import platform
import socket
import time
import uuid
from collections.abc import Callable, Iterator
from datetime import datetime, timezone
from importlib import metadata
from pathlib import Path
from typing import Any

from tokenload import quantiles
from tokenload.contracts.manifest import MANIFEST_VERSION, Manifest
from tokenload.errors import ConfigError
from tokenload.load import lag, records
from tokenload.rundir import MANIFEST_FILE, REQUESTS_FILE
from tokenload.servermetrics import scrape as server_metrics
from tokenload.workload.scenario import OPEN_LOOP_KINDS, Scenario

RUN_INFO = "run.json"


SCENARIO_FILE = "scenario.json"


LOG_FILE = "locust.log"


# Open-loop sends later than this count as late; more than LATE_WARN_FRACTION late means
# the user pool could not keep up with the arrival rate.
LATE_THRESHOLD_S = 0.010


LATE_WARN_FRACTION = 0.05


# `analyze` finalises a killed run only when every process finished, or none flushed for this long
# (live ones flush every second).
RECOVER_QUIET_S = 5.0


def new_run_id() -> str:
    return f"{datetime.now():%Y%m%d-%H%M%S}-{uuid.uuid4().hex[:6]}"


def default_run_dir(scenario_name: str) -> Path:
    return Path("results") / f"{scenario_name}-{datetime.now():%Y%m%d-%H%M%S}"


def write_run_info(run_dir: Path, run_id: str, scenario: Scenario, channel_public: dict[str, Any]) -> Path:
    """What the manifest needs from the start of the run; returns the resolved scenario's path."""
    seg = run_dir / records.SEGMENTS_DIR
    seg.mkdir(parents=True, exist_ok=True)
    path = seg / SCENARIO_FILE
    records.write_json(path, scenario.to_dict())
    records.write_json(seg / RUN_INFO, {"run_id": run_id, "channel": channel_public, "started_at": time.time()})
    return path


def read_json(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}


def _versions() -> dict[str, str]:
    out = {"python": platform.python_version()}
    for name in ("tokenload", "locust", "gevent", "geventhttpclient", "pyarrow"):
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = "not installed"
    return out


def _iso(ts: float | None) -> str | None:
    return None if ts is None else datetime.fromtimestamp(ts, timezone.utc).isoformat()


def finalise(run_dir: Path, wait_s: float = 0.0, locust_rc: int | None = None, lingering: list[int] | None = None,
             recovered: bool = False, on_sealed: Callable[[Path], object] | None = None) -> records.Merged:
    """Seal the run, merge its segments into requests.parquet and write manifest.json; returns what the merge counted.

    `wait_s` > 0 (a master with workers on other machines): first wait that
    long for every worker to flush its last records. `lingering`: pids of
    Locust processes that had to be killed. `recovered`: finalised by
    `tokenload analyze` for a run whose `tokenload run` was killed. `on_sealed`
    sees the sealed segments directory before it is merged (and removed): the
    live metrics read the last segments there.
    """
    missing = records.wait_for_workers(run_dir, read_json(run_dir / records.SEGMENTS_DIR / "control.json").get(
        "workers", []), wait_s) if wait_s else []
    seg = records.seal(run_dir)
    if on_sealed is not None:
        on_sealed(seg)
    info, control = read_json(seg / RUN_INFO), read_json(seg / "control.json")
    scenario = read_json(seg / SCENARIO_FILE)
    states = records.worker_states(seg)
    server = server_metrics.collect(seg, run_dir)  # before the merge removes the sealed directory
    merged = records.merge_segments(run_dir, seg)
    ended = max((s.get("updated_at", 0.0) for s in states.values()), default=time.time())
    warnings: list[str] = []
    ok_share = merged.finished_ok / merged.finished if merged.finished else 0.0
    scheduler_lag = lag.summarise(records.process_lags(states), ok_share)
    if scheduler_lag.get("warning"):
        warnings.append(scheduler_lag["warning"])
    if scheduler_lag.get("stalls"):
        warnings.append(scheduler_lag["stalls"]["note"])
    lateness = _lateness(run_dir / REQUESTS_FILE, scenario) if merged.rows else {}
    if lateness.get("warning"):
        warnings.append(lateness["warning"])
    # A worker that never marked itself done was killed or crashed: what it flushed (every
    # second) is kept, the records of its last second and its open streams are lost.
    unfinished = missing if wait_s else sorted(w for w, s in states.items() if not s.get("done"))
    local = [w for w in unfinished if "courier" not in states.get(w, {})]
    if local:
        last = ", ".join(f"{w} (last flush {_iso(states.get(w, {}).get('updated_at'))})" for w in local)
        warnings.append(f"workers did not finish (killed or crashed): {last}; records after their last flush "
                        "are lost (at most about 1 s of each)")
    remote = [w for w in unfinished if w not in local]
    if remote:  # sending over Locust's channel: its batches did not all reach the master in time
        last = ", ".join(f"{w} (last batch received for its flush at {_iso(states[w].get('updated_at'))})"
                         for w in remote)
        warnings.append(f"the last record batches of workers {last} did not arrive over Locust's channel; "
                        "what is missing is in each one's spool (its --out, spool/RUN_ID) and is not in this run")
    # A worker that lost its master (killed, or the network to it cut) stopped early on its own: its
    # records are all there, but its users were missing from the rest of the run.
    cut_off = sorted(w for w, s in states.items() if s.get("lost") and w not in unfinished)
    if cut_off:
        warnings.append("workers stopped early: " + ", ".join(f"{w} ({states[w]['lost']})" for w in cut_off)
                        + "; Locust did not replace their users, the records' active_users say how many ran")
    lost = sorted({*unfinished, *cut_off})
    if lingering:
        warnings.append(f"Locust processes {', '.join(map(str, lingering))} did not exit after the drain time and "
                        "were killed")
    if locust_rc:
        warnings.append(f"Locust exited with code {locust_rc}; see {LOG_FILE}")
    if recovered:
        warnings.append("this run's `tokenload run` was killed; `tokenload analyze` finalised what its processes "
                        "had flushed")
    if merged.copies:
        warnings.append(f"{merged.copies} record(s) were in the segments twice (the same request id at the same "
                        "start); each is kept once")
    manifest: Manifest = {
        "schema_version": MANIFEST_VERSION,
        "run_id": info.get("run_id"),
        "scenario": scenario,
        "channel": info.get("channel"),
        "versions": _versions(),
        "host": {"hostname": socket.gethostname(), "platform": platform.platform(), "cpus": os.cpu_count()},
        "started_at": info.get("started_at"),
        "ended_at": ended,
        "started_at_iso": _iso(info.get("started_at")),
        "ended_at_iso": _iso(ended),
        "stop_reason": control.get("stop_reason") or ("interrupted" if locust_rc or recovered else None),
        "stop": control.get("stop"),
        "drain": control.get("drain"),
        "workers_lost": lost,
        "plan": control.get("plan", []),
        "steps": control.get("steps", []),
        "storms": control.get("storms", []),
        "records": {
            "total": merged.rows,
            "in_flight": merged.in_flight,
            "per_worker": merged.per_worker,
            "written_per_worker": {w: s.get("records") for w, s in states.items()},
            "courier": {w: s["courier"] for w, s in states.items() if "courier" in s},
        },
        "scheduler_lag": scheduler_lag,
        "open_loop_lateness": lateness,
        "warnings": warnings,
    }
    if server is not None:
        manifest["server_metrics"] = server
    records.write_json(run_dir / MANIFEST_FILE, manifest)
    return merged


def recover(run_dir: Path, quiet_s: float = RECOVER_QUIET_S) -> int | None:
    """Finalise a run whose `tokenload run` was killed; the number of records recovered, or None.

    None when there is nothing to recover (no segments, or already finalised).
    A run with a process that has not finished and flushed within the last
    `quiet_s` seconds may still be running: finalising it would seal it under
    that process, so that is a `ConfigError`.
    """
    seg = records.unfinalised(run_dir)
    if seg is None or (run_dir / REQUESTS_FILE).exists():
        return None
    states = records.worker_states(seg).values()
    latest = max((s.get("updated_at", 0.0) for s in states), default=0.0)
    running = not all(s.get("done") for s in states) and time.time() - latest < quiet_s
    if seg.name == records.SEGMENTS_DIR and running:
        raise ConfigError(f"{run_dir} is still being written (a Locust process flushed {time.time() - latest:.0f} s "
                          "ago); wait for the run to end, then analyse it")
    return finalise(run_dir, recovered=True).rows


def _lateness(requests: Path, scenario: dict[str, Any]) -> dict[str, Any]:
    """How late open-loop sends were against their schedule (empty for closed loop), read a row group at a time."""
    if (scenario.get("load") or {}).get("kind") not in OPEN_LOOP_KINDS:
        return {}
    import numpy as np
    import pyarrow.parquet as pq

    parquet = pq.ParquetFile(requests)

    def chunks() -> Iterator[np.ndarray]:
        for group in range(parquet.num_row_groups):
            column = parquet.read_row_group(group, columns=["late_s"]).column(0)
            yield column.to_numpy(zero_copy_only=False).astype(np.float64)

    n, (p50, p99, top) = quantiles.percentiles(chunks, [50, 99, 100])
    if not n:
        return {}
    late = sum(int((chunk > LATE_THRESHOLD_S).sum()) for chunk in chunks())
    frac = late / n
    out: dict[str, Any] = {"p50_s": p50, "p99_s": p99, "max_s": top, "late_fraction": frac,
                           "threshold_s": LATE_THRESHOLD_S}
    if frac > LATE_WARN_FRACTION:
        out["warning"] = (f"the users could not keep up with the arrival rate: {frac:.0%} of sends were more than "
                          f"{LATE_THRESHOLD_S * 1000:.0f} ms late (p99 {out['p99_s']:.2f} s); raise [load] max_users")
    return out
