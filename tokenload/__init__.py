"""tokenload: a load-testing harness for streaming LLM channels.

Data flows one way: channel config -> protocol adapters (wire format in, token
events out) -> Locust users (load) -> request records -> analysis -> report.

As a library (the same steps the `tokenload` commands take)::

    import tokenload

    channel = tokenload.resolve(base_url="http://127.0.0.1:8000/api", model="sim-7b").channel
    run_dir = tokenload.run_scenario(tokenload.load_scenario("smoke"), channel)
    summary = tokenload.analyze_run(run_dir)        # writes summary.json, plots, report.html

`__all__` is the public API. The names are imported on first use: the
analysis pulls in pandas and matplotlib and the load side pyarrow (together
close to a second), which no command should pay for at `import tokenload`.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

if TYPE_CHECKING:
    from tokenload.analysis.compare import compare_runs
    from tokenload.analysis.pipeline import analyze_run
    from tokenload.channel import Channel, resolve
    from tokenload.errors import ConfigError, ErrorKind, HarnessError
    from tokenload.load.runner import run_scenario
    from tokenload.record import RequestRecord
    from tokenload.workload.scenario import Scenario, load_scenario

# Public name -> the module that defines it.
_EXPORTS: dict[str, str] = {
    "Channel": "tokenload.channel",
    "resolve": "tokenload.channel",
    "Scenario": "tokenload.workload.scenario",
    "load_scenario": "tokenload.workload.scenario",
    "run_scenario": "tokenload.load.runner",
    "analyze_run": "tokenload.analysis.pipeline",
    "compare_runs": "tokenload.analysis.compare",
    "RequestRecord": "tokenload.record",
    "ErrorKind": "tokenload.errors",
    "ConfigError": "tokenload.errors",
    "HarnessError": "tokenload.errors",
}

__all__ = [
    "Channel",
    "ConfigError",
    "ErrorKind",
    "HarnessError",
    "RequestRecord",
    "Scenario",
    "__version__",
    "analyze_run",
    "compare_runs",
    "load_scenario",
    "resolve",
    "run_scenario",
]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'tokenload' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
