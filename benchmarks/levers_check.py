"""Check the lever table against a real channel: run a design, then run what each lever predicts and compare.

    python benchmarks/levers_check.py SCENARIO --out DIR [--levers prompt,max_tokens] [--requests 8]
        [CHANNEL flags: --base-url, --protocol, --model (repeatable), --api-key ...]

1. `tokenload run SCENARIO` (a `[design]`: the packaged `levers`, or a smaller one for a slow server) and
   `tokenload analyze`: the lever table.
2. For each chosen lever, one run of the condition it predicts beside the baseline's (a design of the two cells, or
   two load steps), until each has `--requests` finished requests: the change is measured against today on the same
   machine at the same time, as tests/test_levers_run.py does.
3. One line per lever and metric: the predicted change over today (`vs_today`, 95% interval) against the measured
   one, and the predicted and measured medians themselves.

At one user a run of the condition is the counterfactual exactly (no other request shares the server); at more
users the others now send the baseline's condition or the lever's, not the design's mix.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd

from tokenload.analysis.levers import check_scenario, condition_rows

METRICS = ("ttft_s", "tpot_s", "e2e_s")


def tokenload(*args: str) -> None:
    subprocess.run([sys.executable, "-m", "tokenload", *args], check=True, stdout=subprocess.DEVNULL)


def ratio_ci(new: np.ndarray, today: np.ndarray, seed: int = 0) -> list[float]:
    """95% bootstrap interval of the ratio of the two medians: a check run's own sampling noise."""
    rng = np.random.default_rng(seed)
    draws = [np.median(rng.choice(new, len(new))) / np.median(rng.choice(today, len(today))) for _ in range(2000)]
    return [float(v) for v in np.quantile(draws, [0.025, 0.975])]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("scenario")
    parser.add_argument("--out", required=True)
    parser.add_argument("--levers", default="prompt,max_tokens")
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--model", action="append", default=[])
    args, channel = parser.parse_known_args()
    out = Path(args.out)
    base = out / "base"
    models = [x for m in args.model for x in ("--model", m)]
    if not (base / "summary.json").exists():
        tokenload("run", args.scenario, "--out", str(base), *channel, *models)
        tokenload("analyze", str(base))
    summary = json.loads((base / "summary.json").read_text())
    baseline = summary["lever_baseline"]
    rows = []
    for lever in summary["levers"]:
        if lever["lever"] not in args.levers.split(",") or lever.get("condition") is None:
            continue
        run_dir = out / lever["lever"]
        if not (run_dir / "requests.parquet").exists():
            scenario = out / f"check-{lever['lever']}.toml"
            scenario.write_text(check_scenario(lever, baseline, args.requests, max_step_s=1200), encoding="utf-8")
            pair = sorted({lever["condition"]["model"], baseline["condition"]["model"]})
            tokenload("run", str(scenario), "--out", str(run_dir), *channel, *(x for m in pair for x in ("--model", m)))
        records = pd.read_parquet(run_dir / "requests.parquet")
        for key in METRICS:
            got, ref = (condition_rows(records, x["condition"])[key].to_numpy(float) for x in (lever, baseline))
            new, today = float(np.median(got)), float(np.median(ref))
            measured_ci = ratio_ci(got, ref)
            predicted = lever["vs_today"][key]
            lo, hi = predicted["ci"]
            inside = bool(lo <= new / today <= hi)
            overlap = bool(measured_ci[0] <= hi and lo <= measured_ci[1])
            rows.append({"lever": lever["change"], "metric": key, "predicted_ratio": predicted, "measured_ratio":
                         new / today, "measured_ratio_ci": measured_ci, "n": [len(got), len(ref)], "inside": inside,
                         "intervals_overlap": overlap, "predicted": [lever[key], *lever["ci"][key]], "measured": new,
                         "measured_today": today, "predicted_today": baseline[key]})
            print(f"{lever['change']}: {key[:-2].upper()} x{predicted['ratio']:.3g} [{lo:.3g}, {hi:.3g}] predicted, "
                  f"x{new / today:.3g} [{measured_ci[0]:.3g}, {measured_ci[1]:.3g}] measured ({new:.3g} / {today:.3g} s, "
                  f"n={len(got)}/{len(ref)}; predicted {lever[key]:.3g} [{lever['ci'][key][0]:.3g}, "
                  f"{lever['ci'][key][1]:.3g}] s): {'inside' if inside else 'OUTSIDE'}"
                  f"{'' if inside else '; the intervals overlap' if overlap else '; the intervals do not overlap'}")
    (out / "levers_check.json").write_text(json.dumps(rows, indent=2) + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()
