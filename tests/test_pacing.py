"""Rate-limit headers, back-off and the pacing gate: each rule on its own, then the simulator's real headers."""

from __future__ import annotations

import time
from email.utils import formatdate
from itertools import count
from pathlib import Path

import httpx
import pandas as pd
import pytest

from fakeserver import FakeServer, Received, Script, json_script, stream_script
from loadkit import run_cli, write_scenario

from tokenload.doctor import OK, diagnose_channel
from tokenload.limits import RateInfo, parse_duration, parse_rate_headers
from tokenload.load.pacing import BACKOFF_CAP_S, MAX_WAIT_S, Pacer, backoff_s, pushed_back
from tokenload.sim import launch

NOW = 1_800_000_000.0


def limits(info: RateInfo) -> tuple[int | None, ...]:
    return info.requests_limit, info.requests_remaining, info.tokens_limit, info.tokens_remaining


@pytest.mark.parametrize("text, seconds", [
    ("1s", 1.0), ("6m0s", 360.0), ("1h2m3.5s", 3723.5), ("20ms", 0.02), ("0.5", 0.5), ("12", 12.0),
    ("soon", None), ("1x", None), ("", None),
])
def test_openai_reset_durations(text: str, seconds: float | None) -> None:
    assert parse_duration(text) == (None if seconds is None else pytest.approx(seconds))


def test_anthropic_headers_are_read_as_values() -> None:
    reset = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(NOW + 30))
    info = parse_rate_headers({
        "anthropic-ratelimit-requests-limit": "50", "anthropic-ratelimit-requests-remaining": "0",
        "anthropic-ratelimit-requests-reset": reset, "anthropic-ratelimit-input-tokens-limit": "40000",
        "anthropic-ratelimit-input-tokens-remaining": "39000", "anthropic-ratelimit-input-tokens-reset": reset,
    }, NOW)
    assert limits(info) == (50, 0, 40000, 39000)
    assert info.requests_reset_s == pytest.approx(30)
    assert info.server_wait() == pytest.approx(30)  # no retry-after: the reset of the exhausted limit


def test_openai_headers_and_retry_after_ms_wins() -> None:
    info = parse_rate_headers({
        "x-ratelimit-limit-requests": "500", "x-ratelimit-remaining-requests": "499",
        "x-ratelimit-reset-requests": "120ms",
        "x-ratelimit-limit-tokens": "30000", "x-ratelimit-remaining-tokens": "0", "x-ratelimit-reset-tokens": "6m0s",
        "retry-after": "2", "retry-after-ms": "1500",
    }, NOW)
    assert limits(info) == (500, 499, 30000, 0)
    assert info.retry_after_s == 1.5 and info.server_wait() == 1.5  # retry-after-ms, then retry-after, then resets
    assert parse_rate_headers({"x-ratelimit-remaining-tokens": "0", "x-ratelimit-reset-tokens": "6m0s"},
                              NOW).server_wait() == 360


def test_retry_after_as_an_http_date() -> None:
    info = parse_rate_headers({"retry-after": formatdate(NOW + 7, usegmt=True)}, NOW)
    assert info.retry_after_s == pytest.approx(7)


def test_a_relays_prefixed_headers_are_read_and_its_60_s_is_waited() -> None:
    """LiteLLM's router: a 429 whose only wait is `llm_provider-retry-after: 60`; 60 s, not 1, 2, 4, 8, 16."""
    info = parse_rate_headers({"llm_provider-retry-after": "60", "content-type": "application/json"}, NOW)
    assert info.retry_after_s == 60 and info.server_wait() == 60
    assert [backoff_s(info, n) for n in (1, 2, 5)] == [60, 60, 60]
    pacer = Pacer()
    assert pacer.observe(True, info, 100.0) == 60 and pacer.held(100.0) == 60
    relayed = parse_rate_headers({"llm_provider-retry-after-ms": "2500", "llm_provider-retry-after": "3",
                                  "llm_provider-anthropic-ratelimit-requests-limit": "50"}, NOW)
    assert relayed.retry_after_s == 2.5 and relayed.requests_limit == 50
    assert parse_rate_headers({"llm_provider-x-ratelimit-limit-requests": "3",
                               "llm_provider-x-ratelimit-remaining-requests": "0",
                               "llm_provider-x-ratelimit-reset-requests": "20s"}, NOW).server_wait() == 20
    # the relay's own header wins over its backend's
    assert parse_rate_headers({"retry-after": "5", "llm_provider-retry-after": "60"}, NOW).retry_after_s == 5


def test_no_headers_no_facts() -> None:
    assert parse_rate_headers(None, NOW).empty and parse_rate_headers({"content-type": "x"}, NOW).empty


def test_backoff_follows_the_server_else_doubles_to_a_cap() -> None:
    assert backoff_s(RateInfo(retry_after_s=3), 5) == 3
    assert backoff_s(RateInfo(retry_after_s=86_400), 1) == MAX_WAIT_S  # a daily quota does not stall the run for a day
    assert [backoff_s(RateInfo(), n) for n in (1, 2, 3, 4)] == [1, 2, 4, 8]
    assert backoff_s(RateInfo(), 30) == BACKOFF_CAP_S


def test_what_counts_as_a_push_back() -> None:
    assert pushed_back(429, "rate_limited") and pushed_back(529, "overloaded") and pushed_back(503, "overloaded")
    assert pushed_back(200, "overloaded")  # an in-stream overloaded_error event
    assert not pushed_back(500, "server_error") and not pushed_back(401, "auth") and not pushed_back(200, None)


def test_a_push_back_holds_the_process_and_a_success_resets_the_streak() -> None:
    pacer = Pacer()
    assert pacer.held(0.0) == 0 and pacer.book(100, 0.0) == 0  # no caps, no hold: send now
    assert pacer.observe(True, RateInfo(), 10.0) == 1  # no header: 1 s
    assert pacer.observe(True, RateInfo(), 10.2) == 1  # sent before the hold: the same wave
    assert pacer.held(10.5) == pytest.approx(0.7)
    assert pacer.observe(True, RateInfo(), 11.5) == 2  # the next wave waits twice as long
    assert pacer.observe(False, RateInfo(), 14.0) is None and pacer.streak == 0
    assert pacer.held(14.0) == 0


def test_a_channel_that_went_down_is_backed_off_but_not_taken_for_a_rate_limit() -> None:
    """Refused connections once it had answered: 1, 2, 4 ... s between waves (no thousands of instant records),
    and no pacing under an announced limit afterwards (it did not limit us, it was down)."""
    pacer = Pacer()
    assert pacer.observe(False, RateInfo(), 10.0, down=True) == 1
    assert pacer.observe(False, RateInfo(), 11.0, down=True) == 2
    assert pacer.held(11.5) == pytest.approx(1.5) and not pacer.limited
    assert pacer.observe(False, RateInfo(), 20.0) is None and pacer.streak == 0


def test_an_exhausted_limit_holds_until_its_reset_without_a_429() -> None:
    pacer = Pacer()
    pacer.observe(False, RateInfo(requests_limit=60, requests_remaining=0, requests_reset_s=20), 100.0)
    assert pacer.held(100.0) == pytest.approx(20)


def test_caps_space_sends_and_are_shared_by_workers() -> None:
    pacer = Pacer(max_rps=4)
    assert [pacer.book(0, 0.0) for _ in range(4)] == pytest.approx([0, 0.25, 0.5, 0.75])
    pacer = Pacer(max_rps=4)
    pacer.workers = 2  # each of two processes takes half
    assert [pacer.book(0, 0.0) for _ in range(3)] == pytest.approx([0, 0.5, 1.0])
    pacer = Pacer(max_tokens_per_min=6000)  # 100 tokens/s
    assert [pacer.book(50, 0.0) for _ in range(3)] == pytest.approx([0, 0.5, 1.0])


def test_announced_limits_pace_only_after_the_channel_pushed_back() -> None:
    pacer = Pacer()
    pacer.observe(False, RateInfo(requests_limit=120, requests_remaining=100), 0.0)
    assert [pacer.book(0, 0.0) for _ in range(3)] == [0, 0, 0]  # the user's load, as asked
    pacer.observe(True, RateInfo(retry_after_s=1), 0.0)
    assert pacer.held(0.5) == pytest.approx(0.5)
    assert [pacer.book(0, 1.0) for _ in range(3)] == pytest.approx([0, 0.5, 1.0])  # then 120/min = 2/s


def test_a_lifted_pause_frees_the_gate() -> None:
    pacer = Pacer()
    pacer.hold(1e9)
    assert pacer.held(0.0) > 1e8
    pacer.release()
    assert pacer.held(0.0) == 0


@pytest.mark.parametrize("path, protocol", [("/v1/messages", "anthropic"), ("/v1/chat/completions", "openai")])
def test_the_ratelimited_simulator_speaks_each_vendors_headers(tmp_path: object, path: str, protocol: str) -> None:
    """Real HTTP: the `ratelimited` profile's headers, as parsed, count down and end in a 429 with a wait."""
    body = {"model": "sim-7b", "max_tokens": 1, "stream": True, "messages": [{"role": "user", "content": "hi"}]}
    profile = tmp_path / "tight.toml"  # type: ignore[operator]
    profile.write_text('extends = "ratelimited"\nrate_limit_rpm = 3\nmax_concurrency = 0\n')
    with launch(["--profile", str(profile)]) as sim, httpx.Client() as http:
        answers = [http.post(sim.base_url + path, json=body, headers={"anthropic-version": "2023-06-01"})
                   for _ in range(4)]
    infos = [parse_rate_headers({k.lower(): v for k, v in r.headers.items()}, time.time()) for r in answers]
    vendor = "anthropic-ratelimit-requests-limit" if protocol == "anthropic" else "x-ratelimit-limit-requests"
    assert all(vendor in r.headers for r in answers[:3])
    assert [r.status_code for r in answers] == [200, 200, 200, 429]
    assert [i.requests_remaining for i in infos[:3]] == [2, 1, 0] and {i.requests_limit for i in infos} == {3}
    assert infos[2].server_wait() == pytest.approx(60, abs=2)  # the third used the last slot: wait for the reset
    assert 55 <= infos[3].server_wait() <= 61
    if protocol == "openai":
        assert "retry-after-ms" in answers[3].headers


@pytest.mark.parametrize("profile, expect", [
    ("ratelimited", "the channel allows 60 requests/min (58 left) and 40,000 tokens/min ("),
    ("fast", "the channel sent no rate-limit headers"),
])
def test_doctor_shows_the_limits_it_saw(tmp_path: Path, profile: str, expect: str) -> None:
    """One doctor line with the announced limits as seen after its two requests; a channel without them says so."""
    home = tmp_path / "home"
    home.mkdir()
    with launch(["--profile", profile]) as sim:
        results, _ = diagnose_channel(flags={"base_url": sim.base_url, "model": "sim-7b"}, env={}, cwd=tmp_path, home=home)
    line = {r.name: r for r in results}["rate_limits"]
    assert line.status == OK and line.saw.startswith(expect), line.saw


@pytest.mark.slow
def test_the_load_path_waits_the_relays_asked_wait(fake_server: FakeServer, tmp_path: Path) -> None:
    """A real `tokenload run` against a relay whose router answers the first request 429 with only
    `llm_provider-retry-after: 2.5` (LiteLLM's form; its real 60 s in miniature): the next request leaves
    2.5 s later, not after the 1 s an unread header would give."""
    posts = count(1)

    def relay(received: Received) -> Script:
        if received.method == "POST" and next(posts) == 1:
            return json_script(429, {"error": {"message": "litellm.RateLimitError: No deployments available",
                                               "type": "None", "param": None, "code": "429"}},
                               headers=(("llm_provider-retry-after", "2.5"),))
        return stream_script("openai-chat", ["a", "b"], 0.0, 0.01)

    fake_server.route(relay)
    scenario = write_scenario(tmp_path, "[prompt]\ntokens = 16\n[output]\nmax_tokens = 4\n"
                                        "[load]\nkind = \"constant\"\nusers = 1\nstep_s = 4\n[stop]\ndrain_s = 1\n")
    result = run_cli(scenario, fake_server.url + "/v1", tmp_path / "run", "--protocol", "openai-chat",
                     "--api-key", "sk-relay-test-1234")
    df = pd.read_parquet(tmp_path / "run" / "requests.parquet").sort_values("started_at")
    assert result.returncode == 0, result.stderr[-2000:]
    first, second = df.iloc[0], df.iloc[1]
    assert first.http_status == 429 and first.retry_after_s == 2.5 and first.backoff_s == 2.5
    assert second.status == "ok" and second.started_at - first.finished_at >= 2.4
    assert second.held_s >= 2.3
