"""What bounds the latency, and the usual advice with the arithmetic filled in.

Decision order (the first that applies wins), so a user fixes causes before symptoms:
0. none (`bound` null): no request finished and none failed beyond the limit (a slow
   channel whose streams were all still open at the end): there is nothing to judge
   a bound from, and the advice says so instead of blaming errors that did not happen.
1. `errors`: more than the SLO's `max_error_rate` of requests failed (input errors
   left out); latency is moot.
2. `queue`: at the highest load at least half the median e2e is load-induced
   (1 - e2e_low / e2e_high >= 0.5): the channel queues or contends.
3. `prefill` or `decode`: the phase whose SLO term the low-load medians miss (TTFT: prefill;
   TPOT or e2e: decode), so the bound and the first fix name the same phase; when both or
   neither miss, `prefill` if TTFT is at least half of e2e at low load, else `decode`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import cast

from tokenload.analysis.windows import level_text
from tokenload.contracts.summary import Bound, Breakpoint, Diagnosis, TtftFit
from tokenload.errors import error_class
from tokenload.failures import fix_for
from tokenload.slo import Slo

QUEUE_SHARE = 0.5
PREFILL_SHARE = 0.5
# A TPOT at or under this (20 tokens/s or faster) reads as normal decode speed.
TPOT_NORMAL_S = 0.05


def _g(x: float) -> str:
    """Short human number: 3 significant digits."""
    return f"{x:.3g}"


def _error_advice(total: int, by_kind: dict[str, int], said: Mapping[str, str | None]) -> list[str]:
    lines = []
    for kind, count in sorted(by_kind.items(), key=lambda kv: -kv[1])[:3]:
        fix = fix_for(kind, said.get(kind)) or "inspect the failing requests in requests.parquet"
        lines.append(f"{count} of {total} requests failed with {kind} ({100 * count / total:.1f}%): {fix}")
    return lines


def _ttft_advice(ttft: float, n_in: float, fit: TtftFit, limit: float) -> list[str]:
    """Common mistake 4: long prompt, large model or load; the fit says how short is short enough."""
    head = f"TTFT p50 {_g(ttft)} s at low load is above the {_g(limit)} s target"
    a, slope, k, power = fit["intercept_s"], fit["slope_s_per_token"], fit["exponent"], fit.get("power")
    if not fit.get("model") or a is None or slope is None or k is None:
        return [f"{head}: shorten the prompt, try a smaller model, or send at off-peak times"]
    if fit.get("intercept_check"):
        return [f"{head}: shorten the prompt, try a smaller model, or send at off-peak times (the TTFT fit is not "
                f"used for advice: {fit['intercept_check']})"]
    if a >= limit:
        return [f"{head}; even an empty prompt takes {_g(a)} s (fit intercept): shortening the prompt "
                "cannot meet it, use a smaller model or send at off-peak times"]
    if fit["model"] == "power" and power is not None:
        b = power["b"]
        n_max = ((limit - a) / b) ** (1.0 / k) if b > 0 else math.inf
        law = f"{_g(a)} + {_g(b)} x n^{k:.2f}"
    else:
        n_max = (limit - a) / slope if slope > 0 else math.inf
        law = f"{_g(a)} + {_g(slope)} x n"
    return [f"{head}: by the fit TTFT = {law} s, prompts of <= {n_max:.0f} input tokens meet it "
            f"(median today {n_in:.0f}): shorten the prompt, or use a smaller model or off-peak times"]


def _e2e_advice(ttft: float, tpot: float, n_out: float, limit: float, ttft_limit: float | None) -> list[str]:
    """Common mistakes 5 and 6: decode speed, or simply long outputs."""
    e2e = ttft + tpot * n_out
    head = (f"at low load TTFT {_g(ttft)} s + TPOT {_g(tpot)} s x {n_out:.0f} tokens = {_g(e2e)} s, "
            f"above the {_g(limit)} s target")
    budget = limit - ttft
    if budget <= 0:
        return [f"{head}; TTFT alone uses the whole budget: cut TTFT first"]
    need = budget / n_out
    cap = math.floor(budget / tpot) if tpot > 0 else 0
    if (ttft_limit is None or ttft <= ttft_limit) and tpot <= TPOT_NORMAL_S:
        return [f"{head}; TTFT and TPOT look normal, the output is long: cap max_tokens at {cap} "
                f"(or need TPOT <= {_g(need)} s at {n_out:.0f} tokens)"]
    return [f"{head}: to meet {_g(limit)} s at {n_out:.0f} tokens with TTFT {_g(ttft)} s you need "
            f"TPOT <= {_g(need)} s; today {_g(tpot)} s: cap max_tokens at {cap} or use a smaller model"]


def _phase(slo: Slo, low: dict[str, float], share_low: float) -> tuple[str, str]:
    """(`prefill` or `decode`, why): the phase whose SLO term the low-load medians miss, else the larger share of e2e."""
    prefill = slo.ttft_s is not None and low["ttft"] > slo.ttft_s
    decode = ((slo.tpot_s is not None and low["tpot"] > slo.tpot_s)
              or (slo.e2e_s is not None and low["ttft"] + low["tpot"] * low["output_tokens"] > slo.e2e_s))
    if prefill and not decode:
        return "prefill", f"at low load TTFT p50 {_g(low['ttft'])} s misses the SLO's {_g(slo.ttft_s or 0)} s"
    if decode and not prefill:
        return "decode", ("at low load TTFT meets the SLO and decode misses it" if slo.ttft_s is not None
                          else "at low load decode misses the SLO")
    return ("prefill" if share_low >= PREFILL_SHARE else "decode"), f"TTFT is {100 * share_low:.0f}% of e2e at low load"


def diagnose_latency(
    *,
    slo: Slo,
    requests: int,
    errors_total: int,
    errors_by_kind: dict[str, int],
    share_ttft: float | None,
    low: dict[str, float],
    high: dict[str, float],
    ttft_fit: TtftFit,
    breakpoint: Breakpoint | None,
    open_requests: int = 0,
    said: Mapping[str, str | None] | None = None,
) -> Diagnosis:
    """Return the contract's `diagnosis` {bound, share_ttft, advice} plus the numbers it rests on.

    `low` and `high` hold p50 ttft/tpot/e2e, median output/input tokens and active
    users of the low-load steps and of the highest-load step; `said`: each error kind's most frequent message,
    which can change its fix (a refused connection is no home page).
    """
    said = said or {}
    # Input errors (a prompt over the context, a refused field) say nothing about the channel's
    # capacity or configuration: they are advised on but do not make the run errors-bound.
    counted = sum(n for kind, n in errors_by_kind.items() if error_class(kind) != "input")
    error_rate = counted / requests if requests else 0.0
    if requests == 0 or low.get("e2e") is None or share_ttft is None:
        if requests == 0:
            lines = ["no requests were recorded: check that the load generator reached the channel (tokenload doctor)"]
        else:
            lines = _error_advice(requests, errors_by_kind, said)
            if open_requests:
                lines.append(f"no request finished: {open_requests} of {requests} were still open when the run ended "
                             "(their TTFT and e2e are censored): the channel is slower than the run's steps; lengthen "
                             "step_s or the run, or lower [output] max_tokens")
        bound = "errors" if counted and error_rate > slo.max_error_rate else None
        return {"bound": cast("Bound | None", bound), "share_ttft": None, "error_rate": round(error_rate, 6), "advice": lines}

    load_share = 1.0 - low["e2e"] / high["e2e"] if high["e2e"] > 0 else 0.0
    share_low = low["ttft"] / low["e2e"] if low["e2e"] > 0 else 0.0
    if error_rate > slo.max_error_rate:
        bound, why = "errors", f"{100 * error_rate:.1f}% of requests failed, above the SLO's {slo.max_error_rate:.0%}"
    elif load_share >= QUEUE_SHARE:
        bound, why = "queue", f"{100 * load_share:.0f}% of the median e2e at the highest load is load"
    else:
        bound, why = _phase(slo, low, share_low)

    # (topic, line): the lines of the bound's own topic come first.
    advice: list[tuple[str, str]] = []
    if errors_total:
        advice += [("errors", line) for line in _error_advice(requests, errors_by_kind, said)]
    if load_share >= QUEUE_SHARE:
        good = breakpoint.get("last_good_load_level") if breakpoint else None
        unit = breakpoint["load_unit"] if breakpoint else "users"
        what = "concurrency" if unit == "users" else "the request rate"
        keep = (f"keep {what} <= {level_text(good, unit)} (the last step before the breakpoint)"
                if good else "lower the load")
        advice.append(("queue", f"median e2e grows from {_g(low['e2e'])} s at {low['load']} to "
                      f"{_g(high['e2e'])} s at {high['load']} ({high['e2e'] / low['e2e']:.1f}x; "
                      f"{100 * load_share:.0f}% of it is load): the channel queues under load; {keep}, or "
                      "send at off-peak times and check with `tokenload compare`"))
    if slo.ttft_s is not None and low["ttft"] > slo.ttft_s:
        advice += [("prefill", line) for line in _ttft_advice(low["ttft"], low["input_tokens"], ttft_fit, slo.ttft_s)]
    if slo.tpot_s is not None and low["tpot"] > slo.tpot_s:
        advice.append(("decode", f"TPOT p50 {_g(low['tpot'])} s/token at low load is above the {_g(slo.tpot_s)} s "
                                 "target: decode speed is set by the model's size and the channel's hardware; a "
                                 "smaller model may meet it"))
    if slo.e2e_s is not None and low["ttft"] + low["tpot"] * low["output_tokens"] > slo.e2e_s:
        advice += [("decode", line) for line in _e2e_advice(low["ttft"], low["tpot"], low["output_tokens"], slo.e2e_s,
                                                            slo.ttft_s)]
    if not advice:
        advice.append((bound, f"at low load the medians (TTFT {_g(low['ttft'])} s, TPOT {_g(low['tpot'])} s, "
                      f"e2e {_g(low['e2e'])} s) meet the SLO ({slo.describe()})"))
    advice.sort(key=lambda item: item[0] != bound)
    return {"bound": cast("Bound | None", bound), "bound_reason": why, "share_ttft": round(share_ttft, 4),
            "share_ttft_low_load": round(share_low, 4),
            "load_share_of_e2e": round(load_share, 4), "error_rate": round(error_rate, 6), "advice": [line for _, line in advice]}
