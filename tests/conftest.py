"""Shared pytest fixtures. Keep it small: fixtures import their machinery from helper modules."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

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
