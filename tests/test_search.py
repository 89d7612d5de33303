"""The breakpoint search's logic: levels probed, verdicts from evidence, the answer, its record on disk."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from analysis.search import after_outage, probe_text, verdict_text
from tokenload.search.bisect import Probe, Search
from tokenload.search.evidence import (
    EDGE_MARGIN,
    LATE,
    MIN_FAIL_REQUESTS,
    ON_TIME,
    Evidence,
    cut_wait,
    decide,
    wilson_interval,
)
from tokenload.slo import Slo
from tokenload.workload.scenario import default_max_probes


def run_search(search: Search, passes: Callable[[float, int], str],
               served: Callable[[float], int | None] = lambda _level: None) -> list[float]:
    """Play a search against a channel whose verdict per (level, trial) is scripted (and the concurrency it
    serves while requests wait at a failing level: `served`); the levels probed."""
    levels = []
    while (level := search.next_level()) is not None:
        trial = 1 + sum(p.level == level for p in search.probes)
        verdict = passes(level, trial)
        levels.append(level)
        attainment = {"pass": 1.0, "fail": 0.2, "undecided": 0.85}[verdict]
        search.record(Probe(level, verdict, trial, 40, attainment, None, 0.0, None, 10.0, 100,  # type: ignore[arg-type]
                            confident=search.full_evidence(level), served=served(level) if verdict == "fail" else None))
        assert len(levels) <= 50
    return levels


@pytest.mark.parametrize("capacity,expected", [
    (8, [1, 2, 4, 8, 16, 12, 10, 9, 8]),
    (4, [1, 2, 4, 8, 6, 5, 4]),
    (1, [1, 2, 1]),
    (24, [1, 2, 4, 8, 16, 32, 24, 28, 26, 25, 24]),
    (27, [1, 2, 4, 8, 16, 32, 24, 28, 26, 27, 27]),
])
def test_users_search_finds_the_capacity_to_one_user_and_confirms_it(capacity: int, expected: list[int]) -> None:
    search = Search("users", 1, 256, 1, max_probes=default_max_probes("users", 1, 256, 1))
    levels = run_search(search, lambda level, _t: "pass" if level <= capacity else "fail")
    assert levels == expected
    assert search.capacity == capacity and search.first_failing == capacity + 1
    assert levels.count(capacity) == 2  # the boundary level held twice


@pytest.mark.parametrize("slots,expected", [
    (4, [1, 2, 4, 8, 5, 4]),
    (24, [1, 2, 4, 8, 16, 32, 24, 25, 24]),
    (96, [1, 2, 4, 8, 16, 32, 64, 128, 96, 97, 96]),
    (1, [1, 2, 1]),
])
def test_the_concurrency_a_slot_limited_channel_served_while_requests_waited_picks_the_next_level(
        slots: int, expected: list[int]) -> None:
    search = Search("users", 1, 256, 1)
    levels = run_search(search, lambda level, _t: "pass" if level <= slots else "fail", lambda _level: slots)
    assert levels == expected  # bisection: 4 [.., 8, 6, 5, 4]; 24 [.., 24, 28, 26, 25, 24]; 96 4 probes more
    assert search.capacity == slots and search.first_failing == slots + 1


@pytest.mark.parametrize("capacity,served,expected", [
    # a channel that queues yet meets the SLO above its slot count: 8 passed with 4 streaming, so 4 says nothing
    # (8 passed on the way up: tried again first, then the bisection)
    (12, 4, [1, 2, 4, 8, 16, 8, 12, 14, 13, 12]),
    # a hint in the bracket's upper half is not followed (a channel slowed without a queue serves about as many
    # as it was sent: following 120, 119, ... could cost a probe per user)
    (100, 120, [1, 2, 4, 8, 16, 32, 64, 128, 96, 112, 104, 100, 102, 101, 100]),
    # a wrong hint costs two levels at most, never the answer: 20 streaming while the channel carries 22
    # (bisection: [.., 32, 24, 20, 22, 23, 22])
    (22, 20, [1, 2, 4, 8, 16, 32, 20, 21, 26, 24, 22, 23, 22]),
])
def test_a_served_concurrency_that_does_not_bound_the_capacity_falls_back_to_bisection(
        capacity: int, served: int, expected: list[int]) -> None:
    search = Search("users", 1, 256, 1, max_probes=default_max_probes("users", 1, 256, 1))
    levels = run_search(search, lambda level, _t: "pass" if level <= capacity else "fail", lambda _level: served)
    assert levels == expected
    assert search.capacity == capacity and search.first_failing == capacity + 1
    rate = Search("rate", 1.0, 100.0, 0.1)  # open loop: a concurrency is no rate
    bisected = run_search(Search("rate", 1.0, 100.0, 0.1), lambda level, _t: "pass" if level <= 13.3 else "fail")
    assert run_search(rate, lambda level, _t: "pass" if level <= 13.3 else "fail", lambda _level: 13) == bisected


def test_a_hint_that_lands_on_an_undecided_level_still_finds_a_decided_failure_near_the_boundary() -> None:
    # The eight-slot server: 9 users wait ~0.1 s for a slot, right at the target (undecided); 16 fail with 8
    # streaming. The hint probes 9; the bracket [8, 9] is closed, but the lowest decided failure is 16: the levels
    # between are bisected (12, 10) before the capacity's second trial, as bisection from above would have.
    search = Search("users", 2, 32, 1, max_probes=default_max_probes("users", 2, 32, 1))
    levels = run_search(search, lambda level, _t: "pass" if level <= 8 else "undecided" if level == 9 else "fail",
                        lambda _level: 8)
    assert levels == [2, 4, 8, 16, 9, 12, 10, 8]
    assert search.capacity == 8 and search.first_failing == 10 and search.bounds() == (8, 9)


@pytest.mark.parametrize("served,named", [(4, True), (5, False), (3, False), (None, False)])
def test_the_verdict_names_the_streams_served_only_where_they_explain_the_boundary(served: int | None,
                                                                                    named: bool) -> None:
    # 4 slots: 4 users pass, 5 fail while 4 stream. A channel that streamed 5 at a failing level (more than fail:
    # no slot limit) or 3 (fewer than pass: it queued yet met the SLO) is not explained by them.
    s = {"unit": "users", "probes": [{}] * 6, "duration_s": 67.0, "tokens": 3700, "capacity": 4, "first_failing": 5,
         "below_range": False, "above_range": False, "interval": [4, 5], "binding_detail": "TTFT p90 2.1 s > 2 s",
         "binding": "ttft", "disagreements": [], "undecided": [], "stopped": None, "served": served}
    text = verdict_text(s)
    assert text.startswith("capacity 4 users (5 fails: TTFT p90 2.1 s > 2 s; ") and text.endswith("6 probes, 67 s, 3.7k tokens)")
    assert ("the channel streamed 4 at once while requests waited; boundary in [4, 5]" in text) == named


def test_the_verdict_counts_every_token_spent_and_says_where_it_went() -> None:
    s = {"unit": "users", "probes": [{}] * 6, "duration_s": 67.0, "tokens": 30_634, "capacity": 4, "first_failing": 5,
         "below_range": False, "above_range": False, "interval": [4, 5], "binding_detail": "TTFT p90 2.1 s > 2 s",
         "binding": "ttft", "disagreements": [], "undecided": [], "stopped": None, "served": None,
         "tokens_split": {"counted": 23_000, "warmup": 5_600, "cut": 2_034, "storm_probe": 0, "earlier_runs": 0}}
    assert verdict_text(s).endswith("6 probes, 67 s, 31k tokens (23k counted, 5.6k warm-up, 2.0k cut))")


def _probe(level: int, verdict: str, decided_at: float, binding: str | None = None) -> dict:
    return {"level": level, "verdict": verdict, "this_run": True, "decided_at": decided_at, "binding": binding,
            "binding_detail": f"TTFT p90 {level / 10} s > 0.5 s" if verdict == "fail" else None}


@pytest.mark.parametrize("above", [False, True])
def test_a_level_that_failed_after_the_channel_went_down_is_not_decided(above: bool) -> None:
    # 8 passed at t=10; the channel went down at t=20, during the 9-user probe, which then failed on its errors.
    # With 16 failing before the outage (the search had doubled first) the boundary's top is 16, else open.
    probes = [_probe(8, "pass", 10.0), _probe(9, "fail", 21.0, "ttft")]
    if above:
        probes.insert(1, _probe(16, "fail", 15.0, "ttft"))
    s = {"unit": "users", "probes": probes, "duration_s": 30.0, "tokens": 5000, "capacity": 8, "first_failing": 9,
         "below_range": False, "above_range": False, "interval": (8, 9), "binding_detail": "TTFT p90 0.9 s > 0.5 s",
         "binding": "ttft", "disagreements": [], "undecided": [], "stopped": None, "served": 8}
    after_outage(s, outage_at=20.0)
    assert s["outage_level"] == 9 and s["undecided"] == [9] and s["served"] is None
    assert [p.get("after_outage", False) for p in s["probes"]] == [False] * (1 + above) + [True]
    if above:
        assert s["first_failing"] == 16 and s["interval"] == (8, 16) and s["binding_detail"] == "TTFT p90 1.6 s > 0.5 s"
        assert s["verdict"].startswith("capacity at least 8 users (9 not decided: the channel went down while it "
                                       "was probed; 16 fails: TTFT p90 1.6 s > 0.5 s; boundary in [8, 16]; 3 probes")
    else:
        assert s["first_failing"] is None and s["interval"] == (8, None)
        assert s["verdict"] == ("capacity at least 8 users (9 not decided: the channel went down while it was "
                                "probed; 2 probes, 30 s, 5.0k tokens)")
    slo = {"ttft_s": 0.5, "tpot_s": None, "e2e_s": None}
    row = {**s["probes"][-1], "trial": 1, "n": 10, "attainment": 0.5, "ci": None, "duration_s": 1.0, "tokens": 10}
    assert probe_text(row, "users", slo).startswith("9 users: fail after the channel went down (the outage's errors")


def test_a_failure_decided_before_the_outage_stands() -> None:
    s = {"unit": "users", "probes": [_probe(8, "pass", 10.0), _probe(9, "fail", 19.0, "ttft")], "duration_s": 30.0,
         "tokens": 5000, "capacity": 8, "first_failing": 9, "below_range": False, "above_range": False,
         "interval": (8, 9), "binding_detail": "TTFT p90 0.9 s > 0.5 s", "binding": "ttft", "disagreements": [],
         "undecided": [], "stopped": None, "served": None}
    after_outage(s, outage_at=20.0)
    assert "outage_level" not in s and s["first_failing"] == 9 and not any(p.get("after_outage") for p in s["probes"])


def test_a_probe_row_says_its_verdict_its_evidence_and_its_own_percentiles() -> None:
    slo = {"ttft_s": 0.5, "tpot_s": None, "e2e_s": None}
    steering = {"level": 1, "verdict": "pass", "trial": 1, "n": 5, "attainment": 1.0, "ci": [0.566, 1.0],
                "confident": False, "ttft_p50_s": 0.2, "ttft_p95_s": 0.25, "bounds": [], "duration_s": 2.4,
                "tokens": 446}
    assert probe_text(steering, "users", slo) == ("1 user: steering pass (not confident); 5 of 5 met, 100% [57%, 100%]; "
                                                  "TTFT p50 0.2 · p95 0.25 s; 2.4 s, 446 tokens")
    failing = {**steering, "level": 16, "verdict": "fail", "binding": "ttft", "n": 8, "attainment": 0.0,
               "ci": [0.0, 0.324], "ttft_p95_s": 1.19, "bounds": ["ttft_p95_s"], "trial": 2, "tokens": 2202}
    assert probe_text(failing, "users", slo) == ("16 users, 2nd trial: fail on TTFT; 0 of 8 met, 0% [0%, 32%]; "
                                                 "TTFT p50 0.2 · p95 ≥ 1.19 s; 2.4 s, 2.2k tokens")


def test_served_is_the_90th_percentile_of_the_streaming_counts_taken_while_requests_waited() -> None:
    ev = Evidence()
    assert ev.served is None
    for streaming in (96, 95, 96, 94, 96, 93, 96, 96, 95, 96, 97):  # one 97: a stream's end not read yet
        ev.late(streaming)
    ev.late()  # a cut stream counted late at the end, or a worker's late request: no count
    assert ev.served == 96 and ev.judged == 12
    assert Evidence.from_dict(ev.to_dict()).served == 96
    # a second trial's share: only the counts since the first trial's decision
    later = Evidence.from_dict(ev.to_dict())
    for _ in range(3):
        later.late(40)
    assert later.minus(ev).served == 40 and ev.minus(ev).served is None
    merged = Evidence()
    merged.merge(later)
    assert merged.streams == later.streams


def test_the_capacitys_second_trial_comes_once_the_bracket_closed() -> None:
    # no pass is held on for its second trial right after its first: the capacity is tried again at the end
    search = Search("users", 1, 256, 1)
    run_search(search, lambda level, _t: "pass" if level <= 24 else "fail")
    assert [(p.level, p.trial) for p in search.probes if p.trial > 1] == [(24, 2)]
    assert search.probes[-1].level == 24

def test_a_level_passed_on_the_way_up_is_tried_again_first_when_the_failure_above_streamed_fewer() -> None:
    # 24 slots, identical answers: 32 passed on five early requests (its queue not formed yet), 64 failed with
    # 22 streaming: 32's second trial comes next and fails, and the served count's hint takes it from there
    # (before: 48, 40, 36, 34 and 33 failed one by one, then 32's second trial)
    search = Search("users", 1, 128, 1, max_probes=default_max_probes("users", 1, 128, 1))
    levels = run_search(search, lambda level, trial: "pass" if level <= 26 or (level == 32 and trial == 1)
                        else "fail", lambda _level: 22)
    assert levels == [1, 2, 4, 8, 16, 32, 64, 32, 22, 23, 28, 26, 27, 26]
    assert search.capacity == 26 and search.disagreements == [32]

def test_at_most_ten_probes_for_a_capacity_of_eight() -> None:
    search = Search("users", 1, 64, 1)
    assert len(run_search(search, lambda level, _t: "pass" if level <= 8 else "fail")) <= 10


def test_the_lowest_level_failing_means_below_the_range() -> None:
    search = Search("users", 2, 64, 1)
    assert run_search(search, lambda *_: "fail") == [2]
    assert search.capacity is None and search.first_failing == 2


def test_every_level_passing_means_at_least_the_top() -> None:
    search = Search("users", 1, 8, 1)
    levels = run_search(search, lambda *_: "pass")
    assert levels == [1, 2, 4, 8, 8]
    assert search.capacity == 8 and search.first_failing is None


def test_a_confirmation_that_fails_is_reported_and_the_search_goes_on_below() -> None:
    search = Search("users", 1, 64, 1, max_probes=default_max_probes("users", 1, 64, 1))
    # 8 passes the first time only (a lucky trial): the second trial fails
    levels = run_search(search, lambda level, trial: "pass" if level < 8 or (level == 8 and trial == 1) else "fail")
    assert search.disagreements == [8]
    assert search.capacity == 7 and search.first_failing == 8
    assert levels[-2:] == [7, 7]  # 7 probed and then confirmed


def test_the_capacity_is_confirmed_even_when_an_undecided_level_above_it_closed_the_bracket() -> None:
    # The demo's peak run: 4 passed (steering), 8 and 6 failed, 5 stayed undecided above the target. The bracket
    # [5, 6] is closed, but 5 is never the answer: the capacity 4 had passed only to steer, and ended unconfirmed.
    search = Search("users", 4, 32, 1, target=0.85)
    for level, verdict, attainment, confident in ((4, "pass", 1.0, False), (8, "fail", 0.0, True),
                                                  (6, "fail", 0.4, True), (5, "undecided", 0.87, True)):
        assert search.next_level() == level
        search.record(Probe(level, verdict, 1, 20, attainment, None, 0.0, None, 5.0, 100,  # type: ignore[arg-type]
                            confident=confident))
    assert search.next_level() == 4 and search.full_evidence(4)
    search.record(Probe(4, "pass", 2, 25, 1.0, None, 0.0, None, 5.0, 100))
    assert search.next_level() is None and search.capacity == 4 and search.disagreements == []


def test_rate_search_stops_within_ten_percent() -> None:
    search = Search("rate", 1.0, 100.0, 0.1)
    run_search(search, lambda level, _t: "pass" if level <= 13.3 else "fail")
    assert search.capacity is not None and search.first_failing is not None
    assert search.capacity <= 13.3 < search.first_failing <= search.capacity * 1.1 + 1e-9


def test_an_undecided_probe_steers_but_is_never_the_answer() -> None:
    search = Search("users", 1, 64, 1)
    run_search(search, lambda level, _t: "pass" if level <= 4 else "undecided" if level <= 8 else "fail")
    # undecided at attainment 0.85 (< 0.9): treated as failing for steering (8, then 6, then 5), never named
    assert [p.level for p in search.probes] == [1, 2, 4, 8, 6, 5, 4]
    assert search.capacity == 4 and search.first_failing is None and search.bounds() == (4, 5)


def test_the_search_is_resumed_from_its_record() -> None:
    search = Search("users", 1, 64, 1, target=0.95)
    run_search(search, lambda level, _t: "pass" if level <= 8 else "fail")
    partial = Search.from_dict({**search.to_dict(), "probes": search.to_dict()["probes"][:5]})
    assert partial.target == 0.95
    assert partial.next_level() == 12  # 1, 2, 4, 8, 16 are decided: no probe repeated
    assert Search.from_dict(search.to_dict()).to_dict() == search.to_dict()


def test_max_probes_ends_the_search_with_the_boundary_it_has() -> None:
    search = Search("users", 1, 256, 1, max_probes=6)
    levels = run_search(search, lambda level, _t: "pass" if level <= 24 else "fail")
    assert len(levels) == 6 and search.capacity == 16 and search.first_failing == 32
    assert search.out_of_probes
    search.exhaust()  # what the run does when next_level() says no more: the verdict names the key to raise
    assert search.stopped is not None and "max_probes (6) ran out" in search.stopped
    assert "raise [load] max_probes" in search.stopped


def test_a_search_that_found_its_boundary_is_not_out_of_probes() -> None:
    search = Search("users", 1, 256, 1, max_probes=11)  # 1..32, 24 twice, 28, 26, 25: 11 probes exactly
    run_search(search, lambda level, _t: "pass" if level <= 24 else "fail")
    assert search.capacity == 24 and not search.out_of_probes
    search.exhaust()
    assert search.stopped is None


def test_the_default_max_probes_covers_the_range_the_bisection_and_the_second_trial() -> None:
    for capacity in (1, 3, 24, 96, 127, 200, 256):  # a search of 1..256 to one user never runs out by default
        search = Search("users", 1, 256, 1, max_probes=default_max_probes("users", 1, 256, 1))
        run_search(search, lambda level, _t, c=capacity: "pass" if level <= c else "fail")
        assert search.capacity == capacity and not search.out_of_probes, capacity
    assert default_max_probes("users", 1, 256, 1) == 29
    for capacity in range(1, 257):  # nor with a served concurrency that points anywhere near or below it
        for served in {1, capacity // 2, *range(max(1, capacity - 40), capacity + 1)}:
            search = Search("users", 1, 256, 1, max_probes=default_max_probes("users", 1, 256, 1))
            run_search(search, lambda level, _t, c=capacity: "pass" if level <= c else "fail", lambda _l, s=served: s)
            assert search.capacity == capacity and not search.out_of_probes, (capacity, served)
    rate = Search("rate", 1.0, 100.0, 0.1, max_probes=default_max_probes("rate", 1.0, 100.0, 0.1))
    run_search(rate, lambda level, _t: "pass" if level <= 61 else "fail")
    assert rate.capacity is not None and rate.capacity <= 61 and not rate.out_of_probes


# ------------------------------------------------------------------- evidence

SLO = Slo(ttft_s=0.5, tpot_s=None, e2e_s=None, target=0.9, max_error_rate=0.05)


def evidence(met: int, judged: int, load_errors: int = 0) -> Evidence:
    return Evidence(judged=judged, met=met, load_errors=load_errors)


def test_a_perfect_level_passes_once_the_interval_clears_the_target() -> None:
    assert decide(evidence(20, 20), SLO, 5, 60) is None  # lower end of the interval still below 0.9
    decision = decide(evidence(40, 40), SLO, 5, 60)
    assert decision is not None and decision.verdict == "pass"
    assert decision.ci is not None and decision.ci[0] >= 0.9


def test_a_pass_that_only_steers_is_decided_at_70_percent_and_says_it_is_not_confident() -> None:
    assert decide(evidence(9, 9), SLO, 5, 60, steer=True) is None  # fewer than MIN_REQUESTS decide no pass
    steering = decide(evidence(10, 10), SLO, 5, 60, steer=True)  # the 70% interval's lower end: 0.903
    assert steering is not None and steering.verdict == "pass" and not steering.confident
    assert decide(evidence(15, 16), SLO, 5, 60, steer=True) is None  # one miss in 16: 0.84, not yet
    assert decide(evidence(15, 15), SLO, 5, 60) is None  # the capacity's trial must reach 95%


def test_on_the_way_up_five_hits_without_a_miss_steer_and_the_search_knows_when_it_is_on_the_way_up() -> None:
    assert decide(evidence(4, 4), SLO, 5, 60, steer=True, rising=True) is None
    rising = decide(evidence(5, 5), SLO, 5, 60, steer=True, rising=True)
    assert rising is not None and rising.verdict == "pass" and not rising.confident
    assert decide(Evidence(judged=1, met=1, early=4), TTFT_ONLY, 1, 60, steer=True, rising=True) is not None
    assert decide(evidence(5, 6), SLO, 5, 60, steer=True, rising=True) is None  # one miss: the 70% rule's 10+
    assert decide(evidence(5, 5), SLO, 5, 60, steer=True) is None  # in the bisection: ten at least
    assert decide(evidence(5, 5), SLO, 5, 60, rising=True) is None  # a pass that must be confident: never
    search = Search("users", 1, 64, 1)
    assert search.rising  # the first level too: the doubled one tests it again
    for level, verdict in ((1, "pass"), (2, "pass")):
        search.record(Probe(level, verdict, 1, 5, 1.0, None, 0.0, None, 1.0, 10, confident=False))  # type: ignore[arg-type]
        assert search.rising
    search.record(Probe(4, "undecided", 1, 30, 0.8, None, 0.0, None, 60.0, 10))
    assert not search.rising  # undecided below the target: failing for steering
    search.record(Probe(3, "pass", 1, 10, 1.0, None, 0.0, None, 1.0, 10, confident=False))
    assert not search.rising


def test_a_second_trial_passes_at_95_percent_with_the_first_trials_requests_pooled() -> None:
    assert decide(evidence(19, 19), SLO, 5, 60, prior=(15, 15)) is None  # 34 pooled: not yet 95%
    decision = decide(evidence(20, 20), SLO, 5, 60, prior=(15, 15))
    assert decision is not None and decision.verdict == "pass" and decision.confident
    # the second trial must agree on its own too, at 80% (not only the steering 70%): pooled evidence alone
    # passes nothing
    assert decide(evidence(16, 19), SLO, 5, 60, prior=(200, 200)) is None
    assert decide(evidence(11, 11), SLO, 5, 60, prior=(200, 200)) is None  # 70% would do (0.910), 80% not (0.870)
    agreeing = decide(evidence(15, 15), SLO, 5, 60, prior=(200, 200))
    assert agreeing is not None and agreeing.verdict == "pass" and agreeing.confident
    failing = decide(evidence(0, MIN_FAIL_REQUESTS), SLO, 1, 60, prior=(15, 15))
    assert failing is not None and failing.verdict == "fail"


def test_a_clearly_failing_level_fails_after_a_handful_but_not_on_one_request() -> None:
    assert decide(evidence(0, 1), SLO, 1, 60) is None
    decision = decide(evidence(0, MIN_FAIL_REQUESTS), SLO, 1, 60)
    assert decision is not None and decision.verdict == "fail"


def test_a_level_at_the_boundary_is_undecided_when_time_runs_out() -> None:
    assert decide(evidence(27, 30), SLO, 10, 60) is None
    decision = decide(evidence(27, 30), SLO, 60, 60)
    assert decision is not None and decision.verdict == "undecided" and decision.attainment == 0.9


def test_load_errors_above_the_limit_fail_the_level_with_errors_binding() -> None:
    ev = evidence(14, 20, load_errors=6)
    ev.missed_by["errors"] = 6
    decision = decide(ev, SLO, 5, 60)
    assert decision is not None and decision.verdict == "fail" and decision.binding == "errors"


def record(status: str = "ok", kind: str | None = None, ttft: float | None = 0.2, **extra: float) -> dict[str, object]:
    return {"status": status, "error_kind": kind, "ttft_s": ttft, "tpot_s": 0.02, "itl_p99_s": 0.03, "e2e_s": 1.0,
            **extra}


def test_configuration_and_input_errors_are_not_judged_load_errors_are() -> None:
    ev = Evidence()
    for r in (record(), record(ttft=0.7), record("error", "context_length", None), record("error", "auth", None),
              record("error", "rate_limited", None), record("cancelled", None, None)):
        ev.count(SLO, r)
    assert (ev.judged, ev.met, ev.load_errors) == (3, 1, 1)
    assert ev.missed_by == {"ttft": 1, "errors": 1} and ev.error_kinds == {"rate_limited": 1}


def test_every_set_threshold_is_judged_and_unset_ones_are_not() -> None:
    strict = Slo(ttft_s=0.5, tpot_s=0.01, itl_s=None, e2e_s=None)
    ev = Evidence()
    ev.count(strict, record())  # tpot 0.02 > 0.01
    ev.count(Slo(ttft_s=0.5, tpot_s=None, itl_s=None, e2e_s=None), record())
    assert ev.met == 1 and ev.missed_by == {"tpot": 1}


TTFT_ONLY = Slo(ttft_s=0.5, tpot_s=None, e2e_s=None, target=0.9, max_error_rate=0.05)


def test_only_an_slo_of_ttft_alone_is_decided_at_the_first_token() -> None:
    assert TTFT_ONLY.first_token_decides and SLO.first_token_decides
    assert not Slo(ttft_s=0.5, e2e_s=3.0).first_token_decides  # the e2e term waits for the last token
    assert not Slo(ttft_s=None, e2e_s=3.0).first_token_decides
    assert not Slo(ttft_s=0.5, e2e_s=None, tpot_s=0.05).first_token_decides


def test_early_hits_steer_and_fail_a_level_and_a_confident_pass_needs_finished_requests_of_its_own() -> None:
    early = Evidence(early=10)
    steering = decide(early, TTFT_ONLY, 1, 60, steer=True)  # ten first tokens in time: enough to steer
    assert steering is not None and steering.verdict == "pass" and not steering.confident
    assert (steering.n, steering.early, steering.attainment) == (10, 10, 1.0)
    # a confident pass: its own 80% from finished requests (15 at least), the 95% from all of them
    assert decide(Evidence(early=100), TTFT_ONLY, 1, 60) is None
    assert decide(Evidence(judged=14, met=14, early=30), TTFT_ONLY, 1, 60) is None
    confident = decide(Evidence(judged=15, met=15, early=20), TTFT_ONLY, 1, 60)
    assert confident is not None and confident.confident and (confident.n, confident.early) == (35, 20)
    # early hits weigh against the misses counted in flight: five late alone fail a level, five in 45 do not
    late = Evidence()
    for _ in range(5):
        late.late()
    failing = decide(late, TTFT_ONLY, 1, 60)
    assert failing is not None and failing.verdict == "fail"
    late.early = 40
    assert decide(late, TTFT_ONLY, 1, 60, steer=True) is None


def test_an_early_hit_is_counted_for_good_when_it_finishes_and_as_the_error_it_became_when_it_failed() -> None:
    ev = Evidence()
    ev.on_time()
    ev.on_time()
    ev.late()
    ev.count(TTFT_ONLY, record(), ON_TIME)
    ev.count(TTFT_ONLY, record("error", "disconnected", 0.2), ON_TIME)
    ev.count(TTFT_ONLY, record(ttft=0.9), LATE)  # counted when it was late: not again
    assert (ev.judged, ev.met, ev.load_errors, ev.early) == (3, 1, 1, 0)
    assert ev.missed_by == {"ttft": 1, "errors": 1}
    # a trial's share of the counts: a hit the trial before counted early and that failed now takes one met away
    before = Evidence(early=1)
    after = Evidence(judged=1, load_errors=1)
    assert after.minus(before).with_early == (0, 0)
    assert Evidence.from_dict(Evidence(judged=2, met=1, early=3).to_dict()).with_early == (4, 5)


def test_a_cut_stream_counts_as_far_as_its_first_token_decided_it() -> None:
    cut = {"in_flight": True, "status": "cancelled", "error_kind": None, "ttft_s": 0.2, "duration_s": 3.0}
    never = {**cut, "ttft_s": None}
    ev = Evidence()
    for r in (cut, never):
        ev.count(TTFT_ONLY, r)
    assert (ev.judged, ev.met, ev.missed_by["ttft"]) == (2, 1, 1)
    with_e2e = Evidence()
    with_e2e.count(Slo(ttft_s=0.5, e2e_s=3.0), cut)  # its e2e was never known: left out (censored)
    assert with_e2e.judged == 0


def test_a_second_trial_pools_the_first_trials_early_hits_once() -> None:
    search = Search("users", 1, 8, 1)
    search.record(Probe(4, "pass", 1, 10, 1.0, None, 0.0, None, 2.0, 100, confident=False, early=6))
    prior = search.prior(4)
    assert prior == (10, 10)
    # the second trial's share of the step's counts: the first trial's six early hits finished (early to met,
    # counted once: in the pool through the first trial), 15 new requests finished and 10 more are early hits
    before = Evidence(judged=4, met=4, early=6)
    now = Evidence(judged=4 + 6 + 15, met=4 + 6 + 15, early=10)
    second = now.minus(before)
    assert second.with_early == (25, 25) and second.judged == 21
    decision = decide(second, TTFT_ONLY, 5, 60, prior=prior)  # 35 pooled, 21 finished of its own
    assert decision is not None and decision.verdict == "pass" and decision.confident
    assert decide(now.minus(Evidence(judged=4, met=4, early=7)), TTFT_ONLY, 5, 60, prior=prior) is None  # 34 pooled


def test_wilson_interval_is_the_known_one() -> None:
    lo, hi = wilson_interval(9, 10)  # type: ignore[misc]
    assert lo == pytest.approx(0.5958, abs=1e-4) and hi == pytest.approx(0.9821, abs=1e-4)
    assert wilson_interval(0, 0) is None


def test_a_search_can_be_the_watchers_stress_run_within_its_budget(tmp_path) -> None:  # type: ignore[no-untyped-def]
    import json
    import math

    from tokenload.history.sampler import ESTIMATE_MARGIN, _capacity, parse_stress

    stress = parse_stress("search@03:00,14:00", tmp_path)
    assert stress.hours == (3.0, 14.0)
    # the worst case in flight is every user of the search's top level with its largest request
    assert stress.worst_overshoot() == 256 * (math.ceil(500 * ESTIMATE_MARGIN) + 8 + 200)
    search = Search("users", 1, 64, 1)
    run_search(search, lambda level, _t: "pass" if level <= 8 else "fail")
    (tmp_path / "search.json").write_text(json.dumps(search.to_dict()))
    assert _capacity(tmp_path) == ", capacity 8 users (boundary in [8, 9])"
    assert _capacity(tmp_path / "nothing") == ""



def test_a_cut_stream_without_a_first_token_is_late_by_its_wait_until_the_cut() -> None:
    # a stream cut open has no end (duration_s None): how long it waited is cut_at - started_at
    cut = {"in_flight": True, "status": "cancelled", "error_kind": None, "ttft_s": None, "duration_s": None,
           "started_at": 100.0, "cut_at": 100.8}
    early_cut = {**cut, "cut_at": 100.3}
    ev = Evidence()
    for r in (cut, early_cut):
        ev.count(TTFT_ONLY, r)
    assert (ev.judged, ev.met, ev.missed_by["ttft"]) == (1, 0, 1)  # the one cut at 0.3 s decided nothing
    assert cut_wait(cut) == pytest.approx(0.8) and cut_wait({**cut, "cut_at": None}) is None


def test_a_level_whose_attainment_is_within_the_edge_margin_of_the_target_is_at_the_edge_for_300_requests_not_1000(
        ) -> None:
    # 26 users on 24 slots with identical answers: 0.917 against 0.9. Its 95% interval holds the target until
    # ~1,000 requests; once it lies within the margin either side, the level is at the edge (undecided)
    assert decide(evidence(92, 100), SLO, 5, 60) is None  # [0.850, 0.959]: past 0.9 + 0.05
    edge = decide(evidence(248, 270), SLO, 5, 60)  # [0.880, 0.946]
    assert edge is not None and edge.verdict == "undecided" and edge.edge
    assert edge.ci is not None and 0.9 - EDGE_MARGIN <= edge.ci[0] < 0.9 < edge.ci[1] <= 0.9 + EDGE_MARGIN
    # the pooled interval of a second trial decides it there too; a clear pass or fail is never an edge, nor a
    # level near 1 whose interval still holds the target (50 of 51: [0.896, 0.997], a pass a few requests on)
    second = decide(evidence(124, 135), SLO, 5, 60, prior=(124, 135))
    assert second is not None and second.edge
    assert decide(evidence(50, 51), SLO, 5, 60) is None
    assert decide(evidence(134, 140), SLO, 5, 60).verdict == "pass"  # type: ignore[union-attr]
    assert decide(evidence(112, 140), SLO, 5, 60).verdict == "fail"  # type: ignore[union-attr]
    assert not decide(evidence(27, 30), SLO, 60, 60).edge  # type: ignore[union-attr]  # out of time: not an edge


def test_a_level_at_the_edge_bounds_the_capacity_from_above_and_the_verdict_names_it() -> None:
    # 25 passes, 26 and 27 are at the edge, 28 fails: the capacity is 25 (confirmed), never an edge level, and
    # no level above the edge is probed to find a decided fail next to it
    search = Search("users", 1, 64, 1, max_probes=default_max_probes("users", 1, 64, 1))
    edge_att = {26: 0.917, 27: 0.875}

    def play(level: float) -> tuple[str, float, bool]:
        if level in edge_att:
            return "undecided", edge_att[int(level)], True
        return ("pass", 1.0, False) if level <= 25 else ("fail", 0.5, False)

    while (level := search.next_level()) is not None:
        verdict, att, edge = play(level)
        trial = 1 + sum(p.level == level for p in search.probes)
        search.record(Probe(level, verdict, trial, 140, att, None, 0.0, None, 5.0, 100,  # type: ignore[arg-type]
                            confident=search.full_evidence(level), edge=edge))
        assert len(search.probes) < 30
    assert search.capacity == 25 and search.first_failing is not None and search.bounds() == (25, 26)
    assert search.edges == [26.0]  # 27 is never probed: the bracket [25, 26] is closed
    s = {"unit": "users", "probes": [{}] * 9, "duration_s": 30.0, "tokens": 9000, "capacity": 25, "first_failing": 28,
         "below_range": False, "above_range": False, "interval": [25, 26], "binding_detail": "TTFT p90 0.9 s > 0.5 s",
         "binding": "ttft", "disagreements": [], "undecided": [], "stopped": None, "served": None,
         "edge": [{"level": 26, "ci": [0.856, 0.95]}, {"level": 27, "ci": [0.82, 0.92]}], "slo": {"target": 0.9}}
    text = verdict_text(s)
    assert text.startswith("capacity 25 users (26 users is at the edge: 86–95% against 90% (and 27); 28 fails: ")


def test_a_level_above_the_slots_is_probed_in_a_burst_and_confirmed_spread() -> None:
    # 24 slots, identical answers: 32 failed with 24 streaming. At or below 24 no request waits in any phase:
    # no pause. Above it a level passes in one phase and fails in another: where the fall past the slots is
    # gradual its first trial starts after a pause with every user anew at once, and its second trial spread
    # over a request's time. A pass in the phase the search's history left is tried again in a burst.
    search = Search("users", 1, 128, 1)
    assert search.rephased(40) is None  # nothing failed yet: the channel's slots are unknown
    for level, verdict in ((16, "pass"), (26, "pass"), (32, "fail")):
        search.record(Probe(level, verdict, 1, 10, 1.0 if verdict == "pass" else 0.0, None, 0.0, None, 1.0, 10,  # type: ignore[arg-type]
                            confident=False, served=24 if verdict == "fail" else None))
    assert search.served == 24
    assert search.rephased(16) is None and search.rephased(24) is None and search.rephased(25) is None
    assert search.rephased(26) == "burst"  # passed in the phase the search's history left: tried in a burst
    # 32 failed off a cliff (attainment 0): a level above the slots is first probed where the users are; where
    # the fall is gradual (a third of the requests missing at 32), in a burst
    search.probes[2].attainment = 0.67
    assert search.shape() == "gradual" and search.rephased(25) == "burst"
    search.record(Probe(25, "pass", 1, 25, 0.96, None, 0.0, None, 1.0, 10, confident=False, rephased="burst"))
    assert search.rephased(25) == "spread"
    search.record(Probe(25, "pass", 2, 40, 1.0, None, 0.0, None, 1.0, 10, rephased="spread"))
    assert search.rephased(25) is None
    search.record(Probe(28, "fail", 1, 90, 0.83, None, 0.0, None, 1.0, 10, served=24, rephased="burst"))
    assert search.rephased(28) is None  # a fail in any phase is a fail
    assert search.min_requests(25) == 25 and search.min_requests(24) == 10  # above the slots: a round
    assert Search("rate", 1.0, 100.0, 0.1, probes=[Probe(8.0, "fail", 1, 10, 0.0, None, 0.0, None, 1.0, 10,
                                                         served=4)]).rephased(8.0) is None  # open loop: no phase


def test_a_recount_that_differs_from_the_run_says_why(tmp_path) -> None:  # type: ignore[no-untyped-def]
    # llama.cpp on a busy machine: the run counted a request late at 2 s, but its first token had arrived at
    # 1.99 s by the kernel's stamp (the load generator read it late): the records hold a hit where the run
    # counted a miss, and the probe says so instead of two numbers that disagree without a word
    import json

    import pandas as pd

    from analysis.search import search_summary
    from tokenload.analysis.records import Run

    slo = Slo(ttft_s=2.0, target=0.9)
    probe = Probe(2, "undecided", 1, 4, 0.75, None, 0.0, "ttft", 10.0, 100, step=1, started_at=100.0,
                  decided_at=120.0, run_id="r")
    (tmp_path / "search.json").write_text(json.dumps(Search("users", 1, 8, 1, probes=[probe]).to_dict()))
    df = pd.DataFrame({"step": [1] * 4, "status": ["ok"] * 4, "in_flight": [False] * 4, "phase": ["measure"] * 4,
                       "ttft_s": [0.9, 1.2, 1.1, 1.99], "started_at": [101.0, 102.0, 103.0, 104.0],
                       "finished_at": [107.0, 108.0, 109.0, 110.0], "cut_at": [float("nan")] * 4,
                       "judged_at": [103.0, 104.0, 105.0, 106.0], "judged_in_flight": ["on_time"] * 3 + ["late"],
                       "error_kind": [None] * 4, "input_tokens": [32] * 4, "output_tokens": [32] * 4})
    for column in ("tpot_s", "itl_p50_s", "itl_p99_s", "itl_max_s", "e2e_s"):
        df[column] = float("nan")
    s = search_summary(Run(tmp_path, {"run_id": "r"}, df), slo)
    assert s is not None
    p = s["probes"][0]
    assert (p["n"], p["attainment"]) == (4, 1.0)
    assert p["recount"] == ("the run decided on 4 requests (75.0%); its records hold 4 (100.0%) judged by then: 1 "
                            "counted late had their first token in time by its arrival stamp (read late: the load "
                            "generator lagged)")
