"""The public API of `import tokenload`: the list is pinned, every name resolves, and importing is cheap."""

from __future__ import annotations

import subprocess
import sys

import pytest

import tokenload

PUBLIC = sorted("""
    Channel resolve Scenario load_scenario run_scenario analyze_run compare_runs
    RequestRecord ErrorKind ConfigError HarnessError __version__
""".split())


def test_all_is_pinned() -> None:
    assert sorted(tokenload.__all__) == PUBLIC


def test_every_public_name_resolves_to_its_definition() -> None:
    from tokenload.analysis.compare import compare_runs
    from tokenload.analysis.pipeline import analyze_run
    from tokenload.channel import Channel, resolve
    from tokenload.errors import ConfigError, ErrorKind, HarnessError
    from tokenload.load.runner import run_scenario
    from tokenload.record import RequestRecord
    from tokenload.workload.scenario import Scenario, load_scenario

    expected = {
        "Channel": Channel, "ConfigError": ConfigError, "ErrorKind": ErrorKind, "HarnessError": HarnessError,
        "RequestRecord": RequestRecord, "Scenario": Scenario, "analyze_run": analyze_run,
        "compare_runs": compare_runs, "load_scenario": load_scenario, "resolve": resolve,
        "run_scenario": run_scenario,
    }
    for name in PUBLIC:
        if name != "__version__":
            assert getattr(tokenload, name) is expected[name], name
    assert set(PUBLIC) <= set(dir(tokenload))
    namespace: dict[str, object] = {}
    exec("from tokenload import *", namespace)
    assert set(PUBLIC) <= set(namespace)


def test_unknown_names_and_submodules_still_behave() -> None:
    with pytest.raises(AttributeError, match="no_such_name"):
        tokenload.no_such_name  # noqa: B018
    from tokenload import errors

    assert errors.ConfigError is tokenload.ConfigError


def test_import_tokenload_loads_no_heavy_library() -> None:
    """The CLI imports the package on every command: pandas, matplotlib, pyarrow and Locust wait until used."""
    code = ("import sys, tokenload; heavy = ('pandas', 'matplotlib', 'pyarrow', 'locust', 'numpy', 'httpx'); "
            "print(sorted(m for m in heavy if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
