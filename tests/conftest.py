"""Shared pytest fixtures. Keep it small: fixtures import their machinery from helper modules."""

from __future__ import annotations

import compileall
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).parent))

import contractfiles  # noqa: E402
from machineshare import machine  # noqa: E402

from fakeserver import FakeServer  # noqa: E402

# The simulator fixtures (`fast_sim`; `demo_run`, `history_demo_run` and `diurnal_watch`, the longest runs,
# done side by side) live beside their helpers in tests/simfixtures.py.
pytest_plugins = ["simfixtures"]


@pytest.fixture(scope="session")
def _fake_server_session() -> Iterator[FakeServer]:
    server = FakeServer()
    yield server
    server.close()


@pytest.fixture
def fake_server(_fake_server_session: FakeServer) -> Iterator[FakeServer]:
    """The scripted HTTP server (tests/fakeserver.py), reset for each test: `play(...)` then send requests."""
    _fake_server_session.reset()
    yield _fake_server_session
    _fake_server_session.reset()


# The fast tier (`pytest -m "not slow"`, about 3 minutes) leaves out every test that starts Locust, a whole
# run or a long-lived process, or that computes statistics over a large run. Mark such a test with
# `@pytest.mark.slow`; a module made of them is listed here, and a test that uses the long side-by-side runs
# (`demo_run`, `history_demo_run`, `diurnal_watch`) is slow by that alone.
SLOW_MODULES = frozenset({
    "test_analysis_sim", "test_demo", "test_drain", "test_history_demo", "test_history_report", "test_load_cores",
    "test_load_kind", "test_load_netns", "test_load_process", "test_load_run", "test_load_stop", "test_search_run",
    "test_slo_runs", "test_watch", "test_watch_stress", "test_webui", "test_workloads", "test_levers_run",
})
SLOW_TESTS = frozenset({
    "test_cut_requests_are_censored_not_dropped", "test_interrupted_run_is_flagged_and_gets_no_clean_verdict",
    "test_warmup_goodput_and_percentiles_options", "test_compare_cli_writes_files_and_flags_only_real_shifts",
    "test_compare_pairs_steps_by_load_level_and_says_when_none_are_shared",
    "test_connections_opening_one_new_file_together_all_open", "test_two_writer_processes_on_one_file_lose_nothing",
    "test_any_rechunking_gives_the_events_of_one_feed", "test_cli_writes_summary_plots_and_self_contained_report",
    "test_csv_export_on_demand_has_every_record_and_column",
    "test_run_against_a_server_that_closes_after_each_answer_has_no_disconnected",
    "test_stream_faults_are_recorded_and_the_pool_recovers",
    "test_compare_run_directories_judges_from_its_bootstrap_intervals",
})
LONG_FIXTURES = frozenset({"demo_run", "history_demo_run", "diurnal_watch"})

# The suite runs on several pytest-xdist workers (pyproject's addopts: `-n auto --dist loadgroup`), which take
# tests one at a time; the tests that share an expensive fixture go to one worker together, so that it is made
# once: fixture -> the group's name.
SHARED_FIXTURES = {**{name: "side-by-side" for name in LONG_FIXTURES}, "cache_run": "cache-run",
                   "sim_levers": "sim-levers"}
# Most tests wait on a clock (a Locust plan, a simulator's tokens) far more than they compute: on 2 cores, 5
# workers keep both busy (4 used 1.3 of them: 627-647 s against 558 s with 5). `-n 0` (or
# TOKENLOAD_TEST_WORKERS=0) runs everything in this process.
WORKERS = int(os.environ.get("TOKENLOAD_TEST_WORKERS", "5"))


# Tests that judge timing against a clock run with the machine to themselves (tests/machineshare.py): they
# failed beside other workers' runs. The long side-by-side runs are among them.
ALONE_TESTS = frozenset({
    "test_ttft_follows_the_hour_of_the_simulated_day", "test_a_saturated_client_warns_live_with_advice_that_can_help",
    "test_analyze_does_not_finalise_a_run_that_is_still_writing",
    "test_records_after_a_lost_worker_carry_the_users_really_running",
    "test_a_full_kv_cache_is_named_before_the_queue", "test_auto_stop_is_named_and_related_to_the_slo_breakpoint",
    "test_t0_is_when_the_request_was_out_so_a_held_back_write_is_send_lag_not_ttft",
    "test_cli_simulator_does_not_delay_the_first_token_on_kept_alive_connections",
    "test_a_run_killed_with_sigkill_keeps_the_server_samples_up_to_the_kill",
    # 200 users at once, their TTFT judged against the simulator's truth: 30 ms off at the median beside 4 workers
    "test_a_burst_of_new_users_reads_the_servers_ttft_and_keeps_its_own_wait_in_send_lag",
    # 10 requests/s for 4 s, no send-lag warning: 3 of 40 sends were late beside 4 busy workers
    "test_open_loop_rate_within_10_percent",
    # the two-model server's 2.5x law, judged against its own statement (its timers late under load move it)
    "test_levers_against_an_independent_two_model_server",
})
ALONE_MODULES = frozenset({"test_sim_model"})  # the simulator's timing model


CONTRACT_FILES = pytest.StashKey[tuple[Any, list[str]]]()


def pytest_xdist_auto_num_workers(config: pytest.Config) -> int:
    return WORKERS


def pytest_sessionstart(session: pytest.Session) -> None:
    """Compile the package once, in the controller: the tests start hundreds of Python processes (runs, Locust,
    simulators), and where bytecode is not written (`PYTHONDONTWRITEBYTECODE`, as in CI) each compiled every
    module it imported again, about 0.1 CPU-s a process."""
    if "PYTEST_XDIST_WORKER" not in os.environ:
        compileall.compile_dir(Path(__file__).parents[1] / "tokenload", quiet=1)


def pytest_sessionfinish(session: pytest.Session) -> None:
    """Every summary.json and manifest.json the session wrote validates against the shipped JSON Schemas (in the
    process that owns the session's temporary directory: the controller, or the only process); a file that does
    not fails the session (tests/contractfiles.py)."""
    factory = getattr(session.config, "_tmp_path_factory", None)  # what pytest-xdist gives its workers' paths from
    if "PYTEST_XDIST_WORKER" in os.environ or factory is None:
        return
    counts, problems = contractfiles.check(factory.getbasetemp())
    session.config.stash[CONTRACT_FILES] = (counts, problems)
    if problems:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    counts, problems = terminalreporter.config.stash.get(CONTRACT_FILES, (None, []))
    if counts is None:
        return
    if problems:
        terminalreporter.section("summary.json / manifest.json against their JSON Schemas", red=True)
        for line in problems:
            terminalreporter.write_line(line, red=True)
    older = counts.pop("older manifest.json", 0)
    terminalreporter.write_line(f"contract files: {counts['summary.json']} summary.json and {counts['manifest.json']} "
                                f"manifest.json judged against the shipped JSON Schemas, {len(problems)} problem(s); "
                                f"{older} hand-written manifest.json of an older version not judged",
                                red=bool(problems))


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    """Setup, call and teardown under the machine lock: alone for a test marked `alone`, light for one of the
    fast tier (it may run beside an alone test, one at a time), else shared."""
    hold = "alone" if item.get_closest_marker("alone") else "shared" if item.get_closest_marker("slow") else "light"
    with machine(hold):
        yield


@pytest.hookimpl(tryfirst=True)  # before xdist's own, which reads the xdist_group marks added here
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        module = item.module.__name__.rpartition(".")[2] if isinstance(item, pytest.Function) else ""
        name = item.name.partition("[")[0]
        fixtures = set(getattr(item, "fixturenames", ()))
        if module in SLOW_MODULES or name in SLOW_TESTS or LONG_FIXTURES & fixtures:
            item.add_marker(pytest.mark.slow)
        if module in ALONE_MODULES or name in ALONE_TESTS or LONG_FIXTURES & fixtures:
            item.add_marker(pytest.mark.alone)
            item.add_marker(pytest.mark.xdist_group("alone"))  # one worker runs them all, one after the other
            continue
        for fixture in sorted(fixtures & SHARED_FIXTURES.keys()):
            item.add_marker(pytest.mark.xdist_group(SHARED_FIXTURES[fixture]))
    # The workers take tests in this order: the alone ones first (one worker, while nothing long has started: an
    # alone test waits for every running shared test to end, and the other workers idle meanwhile: 587
    # worker-seconds of a 694 s suite), the fast tier's next (the other workers run them beside the alone ones,
    # one at a time, and all at once between them), then the long ones.
    items.sort(key=lambda item: (item.get_closest_marker("alone") is None, item.get_closest_marker("slow") is not None))
