"""Each stop rule on its own, without Locust: `Live` in, a reason or None out."""

from __future__ import annotations

import dataclasses
import subprocess
import sys

from tokenload.load import stoprules
from tokenload.load.stoprules import Counts, FailFast, FailureStreak, Live
from tokenload.workload.scenario import StopSection

STOP = StopSection()


def live(**kw: object) -> Live:
    return Live(**{"elapsed_s": 12.0, "plan_over": False, "stop": STOP, **kw})  # type: ignore[arg-type]


def test_the_rules_load_without_locust() -> None:
    """The point of the table: a developer's inner loop tests the rules without starting (or importing) Locust."""
    code = ("import sys, tokenload.load.stoprules, tokenload.load.pacing; "
            "print(sorted({'locust', 'gevent'} & set(sys.modules)))")
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout == "[]\n"


def stop(**kw: object) -> StopSection:
    return dataclasses.replace(STOP, **kw)  # type: ignore[arg-type]


def test_nothing_fires_on_a_healthy_run() -> None:
    assert stoprules.first_stop(live(totals=Counts(100, 2, 2, 5000))) is None


def test_plan_over_says_duration_or_plan() -> None:
    assert stoprules.plan_over(live(plan_over=True)) == "plan complete"
    assert stoprules.plan_over(live(plan_over=True, elapsed_s=30.0, stop=stop(duration_s=30))) == "duration"
    assert stoprules.plan_over(live()) is None


def test_budget_spent_local_and_every_worker() -> None:
    assert stoprules.budget_spent(live(budget_spent="max_requests: 40 sent")) == "max_requests: 40 sent"
    spent = {"a": {"sent": 20, "tokens": 100, "reason": "max_requests: 20 sent"},
             "b": {"sent": 20, "tokens": 90, "reason": "token budget: 90 tokens"}}
    assert stoprules.budget_spent(live(workers_spent=spent)) == \
        "max_requests: every worker spent its share (40 requests, 190 tokens)"
    assert stoprules.budget_spent(live()) is None


def test_misconfigured_after_n_in_a_row_and_off_at_zero() -> None:
    error = {"kind": "auth", "http_status": 401, "message": "invalid x-api-key"}
    assert stoprules.misconfigured(live(config_streak=4, config_error=error)) is None
    assert stoprules.misconfigured(live(config_streak=5, config_error=error)) == \
        "channel misconfigured: 5 requests in a row failed with auth (HTTP 401): invalid x-api-key"
    assert stoprules.misconfigured(live(config_streak=50, config_error=error, stop=stop(config_errors=0))) is None
    # it outranks the request limit that would otherwise end a smoke run after 200 failures
    fired = stoprules.first_stop(live(config_streak=5, config_error=error, totals=Counts(200, 200, 0, 0),
                                      stop=stop(max_requests=200)))
    assert fired is not None and fired[0] == "misconfigured"


def test_request_and_token_limits() -> None:
    assert stoprules.request_limit(live(totals=Counts(40, 0, 0, 0), stop=stop(max_requests=40))) == \
        "max_requests: 40 >= 40"
    assert stoprules.request_limit(live(totals=Counts(39, 0, 0, 0), stop=stop(max_requests=40))) is None
    assert stoprules.token_limit(live(totals=Counts(1, 0, 0, 900), stop=stop(max_tokens=800))) == \
        "token budget: 900 >= 800"


def test_breakpoint_counts_load_errors_only() -> None:
    """Three context-length overflows at 1 user are input errors: they do not stop a ramp (issue 9)."""
    ended = {"step": 1, "users": 1, "rate": None, "requests": 3, "failures": 3, "load_failures": 0,
             "load_error_rate": 0.0, "ttft_p95_s": 0.2}
    at = {"ended_step": ended, "stop": stop(breakpoint_error_rate=0.1)}
    assert stoprules.breakpoint_errors(live(**at)) is None
    ended = {**ended, "load_failures": 2, "load_error_rate": 2 / 3}
    assert stoprules.breakpoint_errors(live(**{**at, "ended_step": ended})) == \
        "auto-stop: step 1 (1 users) load error rate 0.67 > 0.1 ([stop] breakpoint_error_rate)"


def test_breakpoint_ttft_names_the_load_level_in_its_unit() -> None:
    ended = {"step": 3, "users": 64, "rate": 8.0, "requests": 30, "load_error_rate": 0.0, "ttft_p95_s": 2.5}
    reason = stoprules.breakpoint_ttft(live(ended_step=ended, stop=stop(breakpoint_ttft_p95_s=1.0)))
    assert reason == "auto-stop: step 3 (8 req/s) TTFT p95 2.50 s > 1 s ([stop] breakpoint_ttft_p95_s)"
    assert stoprules.breakpoint_ttft(live(ended_step=ended)) is None  # off by default


def test_the_rule_that_fired_is_recorded_by_name_and_fields_beside_its_sentence() -> None:
    """manifest.json's `stop`: the analysis reads which auto-stop ended a run from it, not from the sentence."""
    ended = {"step": 3, "users": 64, "rate": 8.0, "requests": 30, "load_error_rate": 0.0, "ttft_p95_s": 2.5}
    at = live(ended_step=ended, stop=stop(breakpoint_ttft_p95_s=1.0))
    fired = stoprules.first_stop(at)
    assert fired is not None and fired[0] == "breakpoint_ttft"
    assert stoprules.record(*fired, at) == {
        "rule": "breakpoint_ttft", "reason": fired[1], "key": "breakpoint_ttft_p95_s", "step": 3,
        "condition": "TTFT p95 2.50 s > 1 s", "value": 2.5, "limit": 1.0}
    assert stoprules.record("plan_over", "plan complete", live(plan_over=True)) == {
        "rule": "plan_over", "reason": "plan complete"}


def test_storm_trigger_and_unresolved_storm() -> None:
    assert stoprules.storm(Counts(9, 9, 9, 0), STOP, users=50) is None  # too few to judge
    assert stoprules.storm(Counts(100, 100, 70, 0), STOP, users=50) is None  # 70% <= 80%
    assert stoprules.storm(Counts(100, 100, 95, 0), STOP, users=50) == \
        "95 of 100 requests failed under load in 10 s (95% > 80%)"
    assert stoprules.storm(Counts(100, 100, 100, 0), stop(storm_error_rate=0), users=50) is None  # off
    detail = "95 of 100 requests failed"
    assert stoprules.storm_unresolved(live(storm_failed_probes=2, storm_detail=detail)) is None
    assert stoprules.storm_unresolved(live(storm_failed_probes=3, storm_detail=detail)) == \
        "error storm: 95 of 100 requests failed; users paused and 3 probe requests 10 s apart failed too"


def test_failfast_streak_counts_config_errors_in_a_row_only() -> None:
    reports: list[int] = []
    ff = FailFast(3, lambda streak, last: reports.append(streak))
    for kind in ("auth", "auth", "context_length", "auth", "bad_base_url", None, "not_found_model"):
        ff.observe(kind, 401, "m")
    assert reports == [1, 2, 0, 1, 2, 0, 1]  # an input error or a success ends the streak
    assert not ff.tripped
    ff.observe("auth", 401, "m")
    ff.observe("auth", 401, "m")
    assert ff.tripped and ff.last == {"kind": "auth", "http_status": 401, "message": "m"}


def test_the_storm_share_needs_as_many_requests_as_users_within_a_floor_and_a_cap() -> None:
    """4 users whose failures each take 4-5 s end about 8 requests per 10 s window: enough, at 4 users."""
    assert [stoprules.storm_minimum(n) for n in (1, 2, 4, 9, 10, 2000)] == [3, 3, 4, 9, 10, 10]
    assert stoprules.storm(Counts(8, 8, 8, 0), STOP, users=4) == "8 of 8 requests failed under load in 10 s (100% > 80%)"
    assert stoprules.storm(Counts(8, 8, 8, 0), STOP, users=2000) is None  # 8 of 2,000 users' worth: too few
    assert stoprules.storm(Counts(2, 2, 2, 0), STOP, users=2) is None  # below the floor


def test_a_brief_blip_does_not_trip_the_storm_breaker() -> None:
    """A burst of failures among successes (the share stays low), or a short streak successes soon end."""
    assert stoprules.storm(Counts(40, 6, 6, 0), STOP, users=4) is None  # 6 failures in a window of 40
    assert stoprules.storm(Counts(5, 3, 3, 0), STOP, users=4, streak=3, quiet_s=30) is None  # 60% and 3 < 4 in a row
    assert stoprules.storm(Counts(5, 3, 3, 0), STOP, users=4, streak=6, quiet_s=4) is None  # nothing worked for 4 s only


def test_failures_slower_than_the_window_trip_the_breaker_by_their_streak() -> None:
    """A hung backend: each failure is a 35 s timeout, so a 10 s window sees one or two, never a share."""
    assert stoprules.storm(Counts(2, 2, 2, 0), STOP, users=4, streak=4, quiet_s=40) == \
        "4 requests in a row failed under load and none succeeded for 40 s"


def test_the_failure_streak_counts_load_failures_in_a_row_across_ticks() -> None:
    streak = FailureStreak(now=0.0)
    streak.observe(Counts(10, 0, 0, 0), 1.0)  # the first tick only sets the baseline
    streak.observe(Counts(14, 0, 0, 0), 2.0)  # successes
    assert (streak.streak, streak.last_ok) == (0, 2.0)
    for t, failed in ((3.0, 1), (4.0, 2), (5.0, 2), (6.0, 2)):
        streak.observe(Counts(14 + failed, failed, failed, 0), t)
    assert (streak.streak, streak.quiet_s(20.0)) == (2, 18.0)
    streak.observe(Counts(18, 4, 4, 0), 7.0)  # two more failures, nothing else
    assert streak.streak == 4
    streak.observe(Counts(20, 5, 5, 0), 8.0)  # a tick with a success among the failures ends the streak
    assert (streak.streak, streak.last_ok) == (0, 8.0)
    streak.observe(Counts(21, 6, 5, 0), 9.0)  # an input error is no load failure: it ends the streak too
    assert streak.streak == 0
    streak.observe(Counts(3, 3, 3, 0), 10.0)  # statistics reset (a new test): start over
    assert (streak.streak, streak.last_ok) == (0, 10.0)
